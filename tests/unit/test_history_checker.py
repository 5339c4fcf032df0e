"""The history checker of the fault tests (tests/support/history.py) on small synthetic
histories: a clean one passes, and each anomaly is found, alone, where it is."""

from __future__ import annotations

import pytest

from tests.support.history import Read, Written, check

A, B = "00000000-0000-0000-0000-00000000000a", "00000000-0000-0000-0000-00000000000b"


def written(*events: tuple[str, int]) -> list[Written]:
    return [Written(key, version, event_id=f"{key}-{version}") for key, version in events]


def log(*events: tuple[str, int, int, int]) -> list[Read]:
    """Reads in the order given: (key, version, partition, offset)."""
    return [
        Read(key, version, partition, offset, event_id=f"{key}-{version}", topic="t")
        for key, version, partition, offset in events
    ]


HISTORY = written((A, 1), (B, 1), (A, 2), (B, 2), (A, 3))
#: A on partition 0, B on partition 1, as a consumer of both may interleave them.
CLEAN = log((A, 1, 0, 0), (B, 1, 1, 0), (A, 2, 0, 1), (B, 2, 1, 1), (A, 3, 0, 2))


def test_a_clean_history_passes() -> None:
    report = check(HISTORY, CLEAN, {A: 3, B: 2})
    assert report.counts == dict.fromkeys(report.counts, 0)
    assert (report.written, report.read, report.keys) == (5, 5, 2)
    report.assert_clean()
    assert "lost 0, duplicated 0, reordered 0, stale 0, unexpected 0" in report.summary()


def test_a_clean_history_without_a_dimension_says_stale_was_not_checked() -> None:
    report = check(HISTORY, CLEAN)
    report.assert_clean()
    assert not report.dimension_checked and "dimension not checked" in report.summary()


def test_an_event_never_read_is_lost() -> None:
    report = check(HISTORY, [r for r in CLEAN if (r.key, r.version) != (B, 2)], {A: 3, B: 2})
    assert [(w.key, w.version) for w in report.lost] == [(B, 2)]
    assert report.counts == {
        "lost": 1,
        "duplicated": 0,
        "reordered": 0,
        "stale": 0,
        "unexpected": 0,
    }
    with pytest.raises(AssertionError, match=rf"lost 1.*\n  lost: {B} v2"):
        report.assert_clean()


def test_an_event_in_the_log_twice_and_one_handed_twice_are_duplicated() -> None:
    reads = [*CLEAN, *log((A, 3, 0, 3), (B, 2, 1, 1))]  # A v3 again at a new offset; B v2 re-sent
    report = check(HISTORY, reads, {A: 3, B: 2})
    found = {(d.key, d.version): d for d in report.duplicated}
    assert set(found) == {(A, 3), (B, 2)}
    assert "in the log" in str(found[(A, 3)]) and "p0@2, t p0@3" in str(found[(A, 3)])
    assert "handed twice at one offset" in str(found[(B, 2)])
    # Read again after nothing higher: a duplicate, not a reordering.
    assert report.counts["duplicated"] == 2 and report.counts["reordered"] == 0
    assert not report.lost and not report.stale and not report.unexpected


def test_a_version_read_after_a_higher_one_is_reordered() -> None:
    reads = log((A, 2, 0, 0), (B, 1, 1, 0), (A, 1, 0, 1), (B, 2, 1, 1), (A, 3, 0, 2))
    report = check(HISTORY, reads, {A: 3, B: 2})
    assert [(r.key, r.earlier.version, r.later.version) for r in report.reordered] == [(A, 2, 1)]
    assert "v1 at t p0@1 read after v2 at t p0@0" in str(report.reordered[0])
    assert report.counts["reordered"] == 1 and sum(report.counts.values()) == 1


def test_a_stale_repeat_after_the_last_version_is_a_duplicate_and_reordered() -> None:
    report = check(HISTORY, [*CLEAN, *log((A, 1, 0, 3))], {A: 3, B: 2})
    assert [(d.key, d.version) for d in report.duplicated] == [(A, 1)]
    assert [(r.key, r.earlier.version, r.later.version) for r in report.reordered] == [(A, 3, 1)]


def test_one_key_read_from_two_partitions_is_reordered() -> None:
    reads = log((A, 1, 0, 0), (B, 1, 1, 0), (A, 2, 3, 0), (B, 2, 1, 1), (A, 3, 0, 1))
    report = check(HISTORY, reads, {A: 3, B: 2})
    assert [r.why for r in report.reordered] == [
        "one key in partitions 0 and 3"
    ]  # ascending Versions, but Kafka orders a partition only


def test_a_dimension_behind_or_missing_a_key_is_stale() -> None:
    report = check(HISTORY, CLEAN, {A: 2})
    assert {(s.key, s.stored, s.last) for s in report.stale} == {(A, 2, 3), (B, None, 2)}
    assert report.counts["stale"] == 2 and sum(report.counts.values()) == 2
    assert f"{B}: dimension missing, last event v2" in report.summary()


def test_what_was_never_written_is_unexpected() -> None:
    reads = [
        *CLEAN,
        *log((A, 9, 0, 3)),  # a Version never written
        Read(B, 2, 1, 2, event_id="someone-else", topic="t"),  # the Version, another event
    ]
    report = check(HISTORY, reads, {A: 3, B: 2, "c": 1})
    whats = sorted(u.what for u in report.unexpected)
    assert len(whats) == 3
    assert any("read at t p0@3" in w for w in whats)  # A v9
    assert any("EventId someone-else" in w for w in whats)
    assert any("in the dimension, not written" in w for w in whats)


def test_a_dimension_ahead_of_the_history_is_unexpected_not_stale() -> None:
    report = check(HISTORY, CLEAN, {A: 4, B: 2})
    assert [(u.key, u.version) for u in report.unexpected] == [(A, 4)]
    assert not report.stale


def test_a_history_writing_one_version_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="written twice"):
        check([*HISTORY, Written(A, 1)], CLEAN)


def test_the_summary_shows_a_few_examples_of_many() -> None:
    many = written(*((A, v) for v in range(1, 21)))
    report = check(many, [], {A: 20})
    assert report.counts["lost"] == 20
    text = report.summary()
    assert text.count("  lost: ") == 6 and "… 15 more" in text
