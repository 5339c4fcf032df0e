"""The loader's insert pipeline (devstats/inserts.py) on its own, on the embedded engine and the
Debian server: batches built by hand, no Kafka. What the loader relies on: every batch handed
back once, in the order sent; no more inserts in flight than the engine takes; a batch with a
group of a batch in flight sent only after that one is confirmed; the guard skipping what is
stored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from pin_pipelines.clickhouse import ClickHouse, open_clickhouse
from pin_pipelines.devstats.batches import Batch
from pin_pipelines.devstats.events import newest_per_group, parse_event
from pin_pipelines.devstats.inserts import InsertPipeline
from tests.support.devstats import Group, physical_rows


def batch(*events: tuple[Group, int], partition_end: int = 1) -> Batch:
    parsed = [parse_event(json.dumps(group.event(version)).encode()) for group, version in events]
    newest = newest_per_group(parsed)
    produced = {key: 0 for key in newest}
    return Batch(newest, [], {0: partition_end}, len(parsed), len(parsed), 0, produced_ms=produced)


@pytest.fixture
def pipeline(clickhouse_url: str) -> Iterator[InsertPipeline]:
    with ExitStack() as stack:
        first = stack.enter_context(open_clickhouse(clickhouse_url))
        writers = [first] + [
            stack.enter_context(open_clickhouse(clickhouse_url))
            for _ in range(first.inserts_in_flight - 1)
        ]
        yield InsertPipeline(writers, attempts=2, backoff_seconds=0.1)


def test_batches_are_handed_back_once_in_the_order_sent(
    pipeline: InsertPipeline, clickhouse: ClickHouse
) -> None:
    """Tried: five batches of distinct groups sent one after another, then settled. A batch is
    handed back only once its insert is confirmed, and at most `inserts_in_flight` are unconfirmed
    at a time (two on the server: the second send hands nothing back, the third the first)."""
    batches = [batch((Group(), 1), partition_end=n + 1) for n in range(5)]
    writers = len(pipeline.free)
    handed: list[Batch] = []
    for sent in batches:
        handed += pipeline.send(sent)
        assert len(pipeline.in_flight) + len(pipeline.free) == writers
        assert handed == batches[: len(handed)]
    handed += pipeline.settle()
    assert handed == batches and not pipeline.in_flight
    for sent in batches:
        group_id = next(iter(sent.newest.values())).id
        assert physical_rows(clickhouse, group_id) == [(1, "Студии v1")]
        assert sent.visible_ms > 0 and sent.fresh
    if writers == 2:  # the server: one batch stored while the next is sent
        again = [batch((Group(), 1)) for _ in range(3)]
        assert list(pipeline.send(again[0])) == []
        assert list(pipeline.send(again[1])) == []
        assert list(pipeline.send(again[2])) == [again[0]]
        assert list(pipeline.settle()) == again[1:]


def test_a_batch_with_a_group_in_flight_waits_for_it(
    pipeline: InsertPipeline, clickhouse: ClickHouse
) -> None:
    """Tried: version 1 of a group sent, then version 2 of it: the second send first confirms
    the first (hands it back), so the group's versions are stored in order on any engine."""
    group, other = Group(), Group()
    first, second = batch((group, 1), (other, 1)), batch((group, 2))
    assert list(pipeline.send(first)) == []
    assert list(pipeline.send(second)) == [first]
    assert list(pipeline.settle()) == [second]
    assert physical_rows(clickhouse, group.id)[-1] == (2, "Студии v2")


def test_the_guard_skips_what_is_stored_and_a_revoke_forgets_the_versions(
    pipeline: InsertPipeline, clickhouse: ClickHouse, clickhouse_url: str
) -> None:
    """Tried: a group stored at version 3, then its versions 2 and 3 sent again (a replay): none
    inserted. After `forget_versions` the guard reads the stored version again instead of trusting
    what it cached: a version written meanwhile by another loader is respected."""
    group = Group()
    stored = batch((group, 3))
    list(pipeline.send(stored))
    list(pipeline.settle())
    replayed = batch((group, 2), (group, 3))
    assert list(pipeline.send(replayed)) + list(pipeline.settle()) == [replayed]
    assert replayed.fresh == [] and replayed.stale == 2
    pipeline.forget_versions()
    assert pipeline.known_versions == {}
    with open_clickhouse(clickhouse_url) as other_loader:
        next_owner = InsertPipeline([other_loader], attempts=1, backoff_seconds=0.1)
        list(next_owner.send(batch((group, 5))))
        list(next_owner.settle())
    late = batch((group, 4))
    list(pipeline.send(late))
    list(pipeline.settle())
    assert late.fresh == []
    versions = [v for v, _ in physical_rows(clickhouse, group.id)]
    assert versions[-1] == 5 and 4 not in versions


def test_abandoned_inserts_are_not_handed_back(pipeline: InsertPipeline) -> None:
    """A lost session: what is in flight is dropped (its partitions' next owner replays it), the
    connections are free again, and settling hands back nothing."""
    writers = len(pipeline.free)
    assert list(pipeline.send(batch((Group(), 1)))) == []
    pipeline.abandon()
    assert list(pipeline.settle()) == [] and len(pipeline.free) == writers
