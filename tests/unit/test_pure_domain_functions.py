"""The pure decisions of the domains, without their services: the dimension's drift kinds
(reconcile), the relay's id runs and its permanent-failure classification, where the loader's
group resumes in a partition and which events a ranged backfill leaves out (devstats)."""

from __future__ import annotations

import uuid
from uuid import UUID

import pytest
from confluent_kafka import KafkaError

from pin_pipelines.devstats.offsets import first_unloaded
from pin_pipelines.devstats.replay import IdRange, RangedReplay
from pin_pipelines.errors import PinError
from pin_pipelines.reconcile import Snapshot, compare
from pin_pipelines.relay.outbox import _id_runs, stuck_failure
from pin_pipelines.relay.producer import Failure

# --- reconcile: compare ---------------------------------------------------------------------------

PROJECT, DEVELOPER = uuid.uuid4(), uuid.uuid4()


def snapshot(version: int, name: str = "A", archived: bool = False) -> Snapshot:
    return Snapshot(
        project_id=PROJECT,
        developer_id=DEVELOPER,
        name=name,
        sort_order=1,
        is_archived=archived,
        version=version,
    )


def test_each_kind_of_dimension_drift() -> None:
    """Tried: one group per kind, plus one in sync. Each gets its kind, the bump floor of its
    re-publication (-1 when the row is missing), and only the groups with a source are
    re-published; a row without a source group is reported, never re-published."""
    ids = {
        kind: uuid.uuid4() for kind in ("same", "missing", "unexpected", "stale", "ahead", "diff")
    }
    source = {
        ids["same"]: snapshot(2),
        ids["missing"]: snapshot(4),
        ids["stale"]: snapshot(5),
        ids["ahead"]: snapshot(3),
        ids["diff"]: snapshot(6, name="B", archived=True),
    }
    dim = {
        ids["same"]: snapshot(2),
        ids["unexpected"]: snapshot(7),
        ids["stale"]: snapshot(4),
        ids["ahead"]: snapshot(9),
        ids["diff"]: snapshot(6),
    }
    drift = compare(source, dim)
    assert drift.checked == 6
    assert drift.kinds == {
        ids["missing"]: "missing",
        ids["unexpected"]: "unexpected",
        ids["stale"]: "stale_version",
        ids["ahead"]: "ahead_version",
        ids["diff"]: "different",
    }
    assert drift.republish == {ids["missing"]: -1, ids["stale"]: 4, ids["ahead"]: 9, ids["diff"]: 6}
    assert set(drift.projects) == set(drift.republish)
    assert drift.by_kind == {
        "missing": 1,
        "unexpected": 1,
        "stale_version": 1,
        "ahead_version": 1,
        "different": 1,
    }
    different = {(r.column, r.stored, r.expected) for r in drift.rows if r.id == ids["diff"]}
    assert different == {("name", "A", "B"), ("is_archived", False, True)}


def test_no_drift_when_both_sides_agree_or_are_empty() -> None:
    gid: UUID = uuid.uuid4()
    assert compare({gid: snapshot(1)}, {gid: snapshot(1)}).kinds == {}
    assert compare({}, {}).checked == 0


# --- relay: id runs and failures ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "runs"),
    [
        ([], ([], [])),
        ([7], ([7], [7])),
        ([1, 2, 3, 5, 6, 9], ([1, 5, 9], [3, 6, 9])),
        # A dead-lettered or unread id (4) is missing: the run ends before it.
        ([3, 1, 2, 5], ([1, 5], [3, 5])),
    ],
)
def test_ids_become_runs_of_consecutive_ids(
    ids: list[int], runs: tuple[list[int], list[int]]
) -> None:
    assert _id_runs(ids) == runs


def test_only_unfixable_delivery_errors_are_permanent() -> None:
    """A too-large or invalid message is dead-lettered; a timeout or a lost leader is retried."""
    permanent = [KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_RECORD, KafkaError.INVALID_MSG]
    retried = [
        KafkaError._MSG_TIMED_OUT,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError._TRANSPORT,
    ]
    assert [Failure(KafkaError(code), b"v").permanent for code in permanent] == [True] * 3
    assert [Failure(KafkaError(code), b"v").permanent for code in retried] == [False] * 3


def test_events_a_refusal_purged_go_out_again_and_anything_else_is_stuck() -> None:
    """Tried: a batch whose event `big` Kafka refused for good (dead-lettered). The events
    librdkafka purged unsent when that refusal failed the transaction are not the broker's
    fault: the rest of the batch goes out again at once (under the parallel test lanes' load the
    refusal came back before the rest was sent, and the relay failed its run on the purges). A
    purge with no refusal, or a timeout beside one, still means the broker did not take it."""
    refused = Failure(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), b"big")
    purged = Failure(KafkaError(KafkaError._PURGE_QUEUE), b"small")
    in_flight = Failure(KafkaError(KafkaError._PURGE_INFLIGHT), b"other")
    timed_out = Failure(KafkaError(KafkaError._MSG_TIMED_OUT), b"late")
    assert stuck_failure([refused, purged, in_flight], {b"big"}) is None
    assert stuck_failure([refused, purged, timed_out], {b"big"}) == timed_out
    assert stuck_failure([purged], set()) == purged


# --- devstats: where the group resumes ------------------------------------------------------------


@pytest.mark.parametrize(
    ("committed", "low", "high", "first"),
    [
        (-1001, 0, 10, 0),  # no commit yet: from the start
        (4, 0, 10, 4),  # the committed offset
        (10, 0, 10, 10),  # at the end: nothing unloaded
        (2, 5, 10, 5),  # below the retention start: from what is left
        (12, 0, 10, 0),  # past the end (topic recreated): replay, never stall
    ],
)
def test_first_unloaded(committed: int, low: int, high: int, first: int) -> None:
    assert first_unloaded(committed, low, high) == first


# --- devstats: a ranged backfill ------------------------------------------------------------------

LOW, MID, HIGH = (UUID(int=n) for n in (0x10, 0x20, 0x30))
#: Probes just outside, at and just inside each end of LOW..MID..HIGH.
PROBES = [UUID(int=n) for n in (0x0F, 0x10, 0x11, 0x20, 0x2F, 0x30, 0x31)]


@pytest.mark.parametrize(
    ("ids", "inside"),
    [
        (IdRange(LOW, HIGH), [0x10, 0x11, 0x20, 0x2F, 0x30]),  # both ends included
        (IdRange(MID, MID), [0x20]),
        (IdRange(MID, None), [0x20, 0x2F, 0x30, 0x31]),  # either alone: half-open
        (IdRange(None, MID), [0x0F, 0x10, 0x11, 0x20]),
        (IdRange(), [0x0F, 0x10, 0x11, 0x20, 0x2F, 0x30, 0x31]),
    ],
)
def test_an_id_range_holds_its_ends(ids: IdRange, inside: list[int]) -> None:
    assert [g.int for g in PROBES if g in ids] == inside
    assert ids.bounded == (ids != IdRange())


def test_an_id_range_orders_ids_as_their_text() -> None:
    """Not as ClickHouse orders its UUID type (the second half first): an id whose first half is
    below the range's start is outside it, whatever its second half."""
    after = IdRange(UUID("00000000-0000-0001-0000-000000000000"), None)
    assert UUID("00000000-0000-0000-ffff-ffffffffffff") not in after
    assert UUID("00000000-0000-0001-0000-000000000001") in after


def test_an_empty_id_range_is_refused() -> None:
    with pytest.raises(PinError, match=f"from-id {HIGH} is greater than to-id {LOW}"):
        IdRange(HIGH, LOW)


def test_a_ranged_replay_loads_every_event_the_group_had_not_passed() -> None:
    replay = RangedReplay(IdRange(MID, MID), passed={0: 5})
    assert replay.skips(LOW, 0, 4) and not replay.skips(MID, 0, 4)
    assert not replay.skips(LOW, 0, 5)  # never loaded: the backfill moves the group past it
    assert not replay.skips(LOW, 1, 0)  # a partition the group had not read
