"""The loader's insert pipeline: each batch guarded by version and sent on a connection of its
own, its answer awaited only when that connection is needed again, so the server stores one
batch while the loader decodes, guards and sends the next (two in flight on a server, one on the
embedded engine, which stores while it is sent: `ClickHouse.inserts_in_flight`).

Every insert is sent in `send` and confirmed in `_confirm_oldest`, oldest first, and the confirmed
batches are handed back in that order: the caller commits a batch's offsets only then."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from contextlib import suppress

from pin_pipelines.clickhouse import ClickHouse, ClickHouseUnavailable
from pin_pipelines.devstats.batches import Batch
from pin_pipelines.devstats.dim import insert_events, stored_versions

log = logging.getLogger("pin_pipelines.devstats")


class InsertPipeline:
    """Inserts in flight over `writers`, retried `attempts` times each, waiting
    `backoff_seconds`, then twice that, … between attempts."""

    def __init__(self, writers: list[ClickHouse], attempts: int, backoff_seconds: float) -> None:
        self.attempts, self.backoff_seconds = attempts, backoff_seconds
        #: Batches sent and not confirmed yet, oldest first, each with its connection; and the
        #: connections with no insert in flight.
        self.in_flight: deque[tuple[Batch, ClickHouse]] = deque()
        self.free: deque[ClickHouse] = deque(writers)
        #: Versions stored or read, by the group's UUID as an int (see newest_per_group): a group
        #: seen again skips the guard query, which costs about as much as the insert. A group's
        #: events are in one partition, and while its partition is assigned this loader is its
        #: only writer; the cycle forgets them (`forget_versions`) when partitions are revoked.
        self.known_versions: dict[int, int] = {}

    def send(self, batch: Batch) -> Iterator[Batch]:
        """Send `batch`'s insert on a connection with none in flight, confirming the oldest
        batches in flight first while there is no such connection or while one of them has a
        group of this batch. Yields the batches confirmed on the way, oldest first (this one too
        when its first attempt failed and a retry stored it); iterate it to the end.

        The second wait keeps a group's versions stored in the order they were consumed, as with
        one connection: among rows of equal UpsertedAt (whole seconds on 18.16) ReplacingMergeTree
        keeps the last inserted, which must be the newest version (dim_layout_group.sql). It also
        lets the guard ignore the batches in flight: they hold none of this batch's groups."""
        while self.in_flight and (not self.free or self._shares_a_group(batch)):
            yield self._confirm_oldest()
        writer = self.free.popleft()
        try:
            self._write(batch, writer)
        except ClickHouseUnavailable as exc:
            yield from self.settle()  # the batches sent before this one finish first
            self._retry(batch, writer, exc)
            self.free.append(writer)
            yield batch
        else:
            self.in_flight.append((batch, writer))

    def settle(self) -> Iterator[Batch]:
        """Confirm every batch in flight, yielding each, oldest first."""
        while self.in_flight:
            yield self._confirm_oldest()

    def abandon(self) -> None:
        """Drop the batches in flight unconfirmed (their partitions are another loader's, which
        replays them), waiting only for the connections to be free again."""
        while self.in_flight:
            _batch, writer = self.in_flight.popleft()
            with suppress(ClickHouseUnavailable):
                writer.confirm_insert()
            self.free.append(writer)

    def forget_versions(self) -> None:
        """The next owner of a partition may overtake the versions cached: read them again."""
        self.known_versions.clear()

    def _shares_a_group(self, batch: Batch) -> bool:
        return any(not batch.newest.keys().isdisjoint(sent.newest) for sent, _ in self.in_flight)

    def _confirm_oldest(self) -> Batch:
        batch, writer = self.in_flight.popleft()
        try:
            writer.confirm_insert()
        except ClickHouseUnavailable as exc:
            self._retry(batch, writer, exc)
        else:
            self._stored(batch)
        self.free.append(writer)
        return batch

    def _write(self, batch: Batch, writer: ClickHouse) -> None:
        """Guard and send the insert (one attempt). The stored versions are read again on every
        attempt: an insert that landed before its answer was lost is then skipped, not stored
        twice."""
        known = self.known_versions
        unseen = [e.id for key, e in batch.newest.items() if key not in known]
        if unseen:
            known.update(stored_versions(writer, unseen))
        batch.fresh = [e for key, e in batch.newest.items() if e.version > known.get(key, -1)]
        if batch.fresh:
            insert_events(writer, batch.fresh)

    def _stored(self, batch: Batch) -> None:
        """The batch is stored: its versions are known, and its events visible from now."""
        self.known_versions.update((e.id.int, e.version) for e in batch.fresh)
        batch.visible_ms = time.time() * 1000

    def _retry(self, batch: Batch, writer: ClickHouse, failed: ClickHouseUnavailable) -> None:
        """Attempts 2, 3, … of a batch whose first attempt (guard, sent insert) failed, waiting
        0.5 s, 1 s, 2 s, … before each; each waits for the server's answer (a silent server is
        found by keepalive within DEAD_PEER_SECONDS: clickhouse/server.py)."""
        attempts = 1
        while attempts < self.attempts:
            # The failed insert may have landed or not: the guard must read, not trust memory.
            for key in batch.newest:
                self.known_versions.pop(key, None)
            wait = self.backoff_seconds * 2 ** (attempts - 1)
            log.warning(
                "ClickHouse insert failed (attempt %d: %s); trying again in %gs",
                attempts,
                failed,
                wait,
            )
            time.sleep(wait)
            attempts += 1
            try:
                self._write(batch, writer)
                writer.confirm_insert()
            except ClickHouseUnavailable as exc:
                failed = exc
            else:
                self._stored(batch)
                return
        raise ClickHouseUnavailable(
            f"{failed} (gave up after {attempts} attempts in "
            f"{time.monotonic() - batch.started:.1f}s; this batch's offsets are not "
            "committed, the next run replays it)"
        ) from failed
