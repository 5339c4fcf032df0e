"""A Jepsen-style checker over the whole history of one fault test: every event
written (to the outbox: what PostgreSQL committed), what a read_committed consumer read from
Kafka, and the dimension's current rows once the fault has healed. One module, for every fault
test of the pipeline.

An event is identified by (key, Version): the recalc writes each Version of an entity once, the
relay publishes each outbox row once, the loader stores a group's Version at most once. The
checker reports, each as a list (and counted):

- lost: written, never read from Kafka;
- duplicated: a (key, Version) read more than once (at two offsets: the log holds it twice; at
  one offset: the consumer was handed it twice);
- reordered: per key, a Version read after a higher one (in the order the consumer returned
  them), or a key read from more than one partition (Kafka orders a partition only);
- stale: a key whose dimension SourceVersion is behind its last written event (or missing);
- unexpected: read or stored, never written (another test's event, a corrupted one, a
  dimension row ahead of the history, an EventId not the one written for that Version).

`check(...)` builds a `Report`; `Report.assert_clean()` fails with a readable summary. The
capture helpers below record a history from the real services: `write_outbox` (rows inserted
in one transaction, as committed), `outbox_history` (the outbox as it is, before a relay deletes
it), `read_committed` (a final read from given offsets to the end), `LiveReader` (a
read_committed consumer that records what it is handed while the fault is on) and
`dimension_versions` (the argMax reads of the dimension).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, Message, TopicPartition
from psycopg.types.json import Jsonb

from pin_pipelines.kafka import client_config
from pin_pipelines.relay import topic_end_offsets
from tests.support.loaders import json_from_child

#: Examples of each anomaly in a summary.
SHOWN = 5


@dataclass(frozen=True)
class Written:
    """An event as the source committed it."""

    key: str
    version: int
    event_id: str | None = None
    outbox_id: int | None = None
    #: time.monotonic() once committed (for the test's own measurements).
    at: float | None = None


@dataclass(frozen=True)
class Read:
    """An event as a consumer was handed it."""

    key: str
    version: int
    partition: int
    offset: int
    event_id: str | None = None
    topic: str | None = None
    #: time.monotonic() when the consumer returned it.
    at: float | None = None

    def where(self) -> str:
        return f"{self.topic + ' ' if self.topic else ''}p{self.partition}@{self.offset}"


@dataclass(frozen=True)
class Duplicate:
    key: str
    version: int
    reads: tuple[Read, ...]

    def __str__(self) -> str:
        offsets = {(r.partition, r.offset) for r in self.reads}
        how = "handed twice at one offset" if len(offsets) < len(self.reads) else "in the log"
        return f"{self.key} v{self.version} read {len(self.reads)}x ({how}): " + ", ".join(
            r.where() for r in self.reads
        )


@dataclass(frozen=True)
class Reordered:
    key: str
    earlier: Read
    later: Read
    why: str

    def __str__(self) -> str:
        return (
            f"{self.key}: v{self.later.version} at {self.later.where()} read after "
            f"v{self.earlier.version} at {self.earlier.where()} ({self.why})"
        )


@dataclass(frozen=True)
class Stale:
    key: str
    stored: int | None
    last: int

    def __str__(self) -> str:
        stored = "missing" if self.stored is None else f"at v{self.stored}"
        return f"{self.key}: dimension {stored}, last event v{self.last}"


@dataclass(frozen=True)
class Unexpected:
    key: str
    version: int
    what: str

    def __str__(self) -> str:
        return f"{self.key} v{self.version}: {self.what}"


@dataclass
class Report:
    written: int
    read: int
    keys: int
    #: False when no dimension was given: `stale` is then not checked (and says so).
    dimension_checked: bool
    lost: list[Written] = field(default_factory=list)
    duplicated: list[Duplicate] = field(default_factory=list)
    reordered: list[Reordered] = field(default_factory=list)
    stale: list[Stale] = field(default_factory=list)
    unexpected: list[Unexpected] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return {
            "lost": len(self.lost),
            "duplicated": len(self.duplicated),
            "reordered": len(self.reordered),
            "stale": len(self.stale),
            "unexpected": len(self.unexpected),
        }

    @property
    def clean(self) -> bool:
        return not any(self.counts.values())

    def summary(self) -> str:
        head = (
            f"history of {self.written} written events ({self.keys} keys), {self.read} reads: "
            + ", ".join(f"{name} {n}" for name, n in self.counts.items())
            + ("" if self.dimension_checked else " (dimension not checked)")
        )
        lines = [head]
        for name in self.counts:
            found: list[Any] = getattr(self, name)
            for item in found[:SHOWN]:
                text = f"{item.key} v{item.version}" if isinstance(item, Written) else str(item)
                lines.append(f"  {name}: {text}")
            if len(found) > SHOWN:
                lines.append(f"  {name}: … {len(found) - SHOWN} more")
        return "\n".join(lines)

    def assert_clean(self) -> None:
        assert self.clean, self.summary()


def check(
    written: Iterable[Written],
    reads: Iterable[Read],
    dimension: Mapping[str, int] | None = None,
) -> Report:
    """The anomalies of a history. `reads` in the order the consumer returned them;
    `dimension` maps a key to its stored SourceVersion (a written key absent from it is
    missing); None leaves `stale` unchecked. Raises ValueError when `written` holds one
    (key, Version) twice: the history itself would be wrong."""
    by_event: dict[tuple[str, int], Written] = {}
    for event in written:
        if (event.key, event.version) in by_event:
            raise ValueError(f"{event.key} v{event.version} written twice: not a history")
        by_event[(event.key, event.version)] = event
    reads = list(reads)
    last: dict[str, int] = {}
    for key, version in by_event:
        last[key] = max(version, last.get(key, version))
    report = Report(len(by_event), len(reads), len(last), dimension is not None)

    seen: dict[tuple[str, int], list[Read]] = defaultdict(list)
    highest: dict[str, Read] = {}
    partition_of: dict[str, Read] = {}
    for read in reads:
        ident = (read.key, read.version)
        seen[ident].append(read)
        source = by_event.get(ident)
        if source is None:
            report.unexpected.append(Unexpected(read.key, read.version, f"read at {read.where()}"))
        elif source.event_id and read.event_id and source.event_id != read.event_id:
            report.unexpected.append(
                Unexpected(
                    read.key,
                    read.version,
                    f"EventId {read.event_id} at {read.where()}, written {source.event_id}",
                )
            )
        first = partition_of.setdefault(read.key, read)
        if (first.topic, first.partition) != (read.topic, read.partition):
            why = f"one key in partitions {first.partition} and {read.partition}"
            report.reordered.append(Reordered(read.key, first, read, why))
        top = highest.get(read.key)
        if top is None or read.version > top.version:
            highest[read.key] = read
        elif read.version < top.version:
            report.reordered.append(Reordered(read.key, top, read, "a lower Version after"))
    report.duplicated = [
        Duplicate(key, version, tuple(found))
        for (key, version), found in seen.items()
        if len(found) > 1
    ]
    report.lost = [event for ident, event in by_event.items() if ident not in seen]

    if dimension is not None:
        for key, version in dimension.items():
            if key not in last:
                report.unexpected.append(Unexpected(key, version, "in the dimension, not written"))
            elif (key, version) not in by_event:
                report.unexpected.append(
                    Unexpected(key, version, f"stored, never written (last v{last[key]})")
                )
        report.stale = [
            Stale(key, dimension.get(key), version)
            for key, version in last.items()
            if dimension.get(key, 0) < version
        ]
    return report


# --- capturing a history from the real services -------------------------------------------


def write_outbox(
    conn: psycopg.Connection, topic: str, events: Sequence[Mapping[str, Any]]
) -> list[Written]:
    """Insert `events` (snapshot payloads with Id, Version, EventId) into the outbox in one
    transaction, keyed by Id as the recalc writes them; returns them as committed (their outbox
    ids, stamped with the commit's time). Nothing is returned when the insert fails."""
    with conn.transaction(), conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO chessboard.outbox_events (topic, message_key, payload)"
            " VALUES (%s, %s, %s)"
            " RETURNING id, message_key, (payload->>'Version')::int, payload->>'EventId'",
            [(topic, str(e["Id"]), Jsonb(dict(e))) for e in events],
            returning=True,
        )
        rows = []
        while True:
            rows.append(cur.fetchone())
            if not cur.nextset():
                break
    at = time.monotonic()
    return [
        Written(str(key), int(version), event_id, int(outbox_id), at)
        for outbox_id, key, version, event_id in (r for r in rows if r is not None)
    ]


def outbox_history(conn: psycopg.Connection, topics: Sequence[str] | None = None) -> list[Written]:
    """The outbox's events as they are now (read them before a relay publishes and deletes
    them), in id order."""
    rows = conn.execute(
        "SELECT id, message_key, (payload->>'Version')::int, payload->>'EventId'"
        " FROM chessboard.outbox_events WHERE %(topics)s::text[] IS NULL OR topic = ANY(%(topics)s)"
        " ORDER BY id",
        {"topics": list(topics) if topics is not None else None},
    ).fetchall()
    return [Written(str(k), int(v), e, int(i)) for i, k, v, e in rows]


def _read(message: Message, at: float) -> Read:
    body = json.loads(bytes(message.value() or b""))
    return Read(
        key=bytes(message.key() or b"").decode(),
        version=int(body["Version"]),
        partition=int(message.partition() or 0),
        offset=int(message.offset() or 0),
        event_id=body.get("EventId"),
        topic=str(message.topic()),
        at=at,
    )


def _consumer(bootstrap: str, **extra: Any) -> Consumer:
    return Consumer(
        {
            **client_config(bootstrap),
            "group.id": f"test-history-{uuid.uuid4()}",  # never joined: assign() only
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            **extra,
        }
    )


def read_committed(
    bootstrap: str,
    start: Mapping[str, Mapping[int, int]],
    keys: set[str] | None = None,
    timeout: float = 60.0,
) -> list[Read]:
    """What a read_committed consumer reads of `keys` (all when None) from `start` ({topic:
    {partition: offset}}) to the end offsets as they are when called, in the order it returned
    them. A partition is done once the consumer reports its end there (commit markers take
    offsets but are never handed out, aborted messages are skipped)."""
    end = topic_end_offsets(bootstrap, list(start))
    remaining = {
        (t, p): end[t][p] for t, parts in start.items() for p, o in parts.items() if end[t][p] > o
    }
    consumer = _consumer(bootstrap, **{"enable.partition.eof": True})
    consumer.assign([TopicPartition(t, p, start[t][p]) for t, p in remaining])
    found: list[Read] = []
    deadline = time.monotonic() + timeout
    try:
        while remaining and time.monotonic() < deadline:
            for message in consumer.consume(1000, timeout=1):
                error = message.error()
                where = (str(message.topic()), int(message.partition() or 0))
                if error is not None:
                    assert error.code() == KafkaError._PARTITION_EOF, error
                    if int(message.offset() or 0) >= remaining.get(where, 0):
                        remaining.pop(where, None)
                    continue
                if keys is None or bytes(message.key() or b"").decode() in keys:
                    found.append(_read(message, time.monotonic()))
    finally:
        consumer.close()
    assert not remaining, f"did not reach the end offsets of {remaining} in {timeout:g}s"
    return found


class LiveReader:
    """A read_committed consumer (assigned, no group) recording every event of `keys` it is
    handed from `start`, with the time, in a thread, while the test runs its fault. Its errors
    (librdkafka's, e.g. a leader it cannot reach) are kept in `errors`; `stop()` ends it."""

    def __init__(
        self, bootstrap: str, start: Mapping[str, Mapping[int, int]], keys: set[str] | None
    ) -> None:
        self.keys = keys
        self.reads: list[Read] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = _consumer(bootstrap)
        self._consumer.assign(
            [TopicPartition(t, p, o) for t, parts in start.items() for p, o in parts.items()]
        )
        self._thread = threading.Thread(target=self._run, name="history-live-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for message in self._consumer.consume(500, timeout=0.2):
                    error = message.error()
                    if error is not None:
                        self.errors.append(str(error))
                        continue
                    if self.keys is None or bytes(message.key() or b"").decode() in self.keys:
                        read = _read(message, time.monotonic())
                        with self._lock:
                            self.reads.append(read)
        finally:
            self._consumer.close()

    def snapshot(self) -> list[Read]:
        with self._lock:
            return list(self.reads)

    def has_read(self, events: Iterable[Written]) -> bool:
        """Whether every one of `events` has been read (at least once)."""
        got = {(r.key, r.version) for r in self.snapshot()}
        return all((e.key, e.version) in got for e in events)

    def stop(self) -> list[Read]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.snapshot()


@contextlib.contextmanager
def live_reader(
    bootstrap: str, start: Mapping[str, Mapping[int, int]], keys: set[str] | None = None
) -> Iterator[LiveReader]:
    """A `LiveReader` stopped (its consumer closed) when the block ends."""
    reader = LiveReader(bootstrap, start, keys)
    try:
        yield reader
    finally:
        reader.stop()


def dimension_versions(clickhouse_url: str, keys: Iterable[str]) -> dict[str, int]:
    """Each key's current SourceVersion in `pin_dev_stats.dim_layout_group` (the loader's own
    argMax read, `dim.stored_versions`); absent keys are missing. chdb opens one folder per
    process: an embedded folder that no owner answers for while this process holds another (an
    earlier module of the worker left it the session's; a CI run failed so, reading between two
    load runs) is read in a child process."""
    from pin_pipelines.clickhouse import ClickHouseError

    ids = sorted(str(uuid.UUID(key)) for key in keys)
    try:
        return _versions(clickhouse_url, ids)
    except ClickHouseError as exc:
        if "already has embedded ClickHouse open" not in str(exc):
            raise
    return dict(json_from_child(_DIMENSION_VERSIONS, clickhouse_url, *ids))


def _versions(clickhouse_url: str, ids: list[str]) -> dict[str, int]:
    from pin_pipelines.clickhouse import open_clickhouse
    from pin_pipelines.devstats.dim import stored_versions

    with open_clickhouse(clickhouse_url) as ch:
        stored = stored_versions(ch, {uuid.UUID(key) for key in ids})
    return {str(uuid.UUID(int=gid)): version for gid, version in stored.items()}


#: `dimension_versions`' child: `_versions` of argv's URL and keys, as JSON.
_DIMENSION_VERSIONS = """
import json, sys
from tests.support.history import _versions
print(json.dumps(_versions(sys.argv[1], sys.argv[2:])))
"""
