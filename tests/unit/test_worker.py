"""The long-lived workers' one loop (pin_pipelines.worker), alone: a fake worker whose runs
return lists of items, tiny durations (no wait here lasts over 0.2 s)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from pin_pipelines.errors import PinError
from pin_pipelines.worker import STOP_POLL_SECONDS, Budget, Retry, check_services, run_until_spent

#: Generous against a loaded CI machine, still far below the waits a broken stop would take.
PROMPT = 0.2


@dataclass
class Items:
    """A run's summary: the items it handled."""

    items: list[int] = field(default_factory=list)

    def merge(self, later: Items) -> None:
        self.items.extend(later.items)

    @property
    def found_work(self) -> bool:
        return bool(self.items)


def runs(*outcomes: list[int] | Exception) -> tuple[Callable[[], Items], list[int]]:
    """A worker whose runs hand out `outcomes` (an exception is raised), then nothing; and the
    count of its runs."""
    queued: Iterator[list[int] | Exception] = iter(outcomes)
    calls: list[int] = []

    def run_once() -> Items:
        calls.append(1)
        outcome = next(queued, [])
        if isinstance(outcome, Exception):
            raise outcome
        return Items(outcome)

    return run_once, calls


def timed(action: Callable[[], object]) -> float:
    started = time.monotonic()
    action()
    return time.monotonic() - started


def test_a_budget_ends_with_its_time_or_its_stop() -> None:
    assert Budget(0).stopping()
    assert Budget(0).remaining() == 0.0
    endless = Budget()
    assert not endless.stopping() and endless.remaining() == math.inf
    ten = Budget(10)
    assert not ten.stopping() and 9 < ten.remaining() <= 10
    stop = threading.Event()
    stoppable = Budget(10, stop.is_set)
    assert not stoppable.stopping()
    stop.set()
    assert stoppable.stopping()


def test_a_wait_lasts_its_seconds_unless_the_budget_ends_or_a_stop_comes() -> None:
    assert 0.05 <= timed(lambda: Budget().wait(0.05)) < PROMPT
    assert timed(lambda: Budget(0.05).wait(30)) < PROMPT
    stop = threading.Event()
    timer = threading.Timer(0.05, stop.set)
    timer.start()
    try:
        assert timed(lambda: Budget(should_stop=stop.is_set).wait(30)) < PROMPT
    finally:
        timer.cancel()


def test_runs_are_merged_into_the_total_returned_once_a_run_finds_nothing_and_idle_ends() -> None:
    """Runs that found work are followed by the next at once (idle not asked); after one that
    found nothing, idle_seconds' None ends the loop: run until idle."""
    run_once, calls = runs([1, 2], [3])
    asked: list[int] = []

    def idle() -> float | None:
        asked.append(1)
        return None

    total = Items([0])
    result = run_until_spent(run_once, Budget(), total, idle_seconds=idle)
    assert result is total
    assert total.items == [0, 1, 2, 3]
    assert (len(calls), len(asked)) == (3, 1)


def test_an_idle_run_waits_idle_seconds_and_the_loop_ends_with_the_budget() -> None:
    run_once, calls = runs([1])
    took = timed(lambda: run_until_spent(run_once, Budget(0.12), Items(), idle_seconds=0.05))
    # Run 1 found work, run 2 did not: 0.05 s, run 3: 0.05 s, run 4 (or not): the budget ends.
    assert 0.12 <= took < 0.12 + PROMPT
    assert 3 <= len(calls) <= 4


def test_a_wake_ends_the_idle_wait_and_idle_seconds_is_then_only_the_backstop() -> None:
    """Tried: a 30 s idle wait whose `wake` reports work on its third slice: the next run
    starts then, not after 30 s; each slice asks at most STOP_POLL_SECONDS (a stop is still
    seen within it); and a wake that never reports lets idle_seconds end the wait."""
    run_once, calls = runs()
    slices: list[float] = []

    def wake(seconds: float) -> bool:
        slices.append(seconds)
        time.sleep(seconds)
        return len(slices) == 3

    budget = Budget(30, lambda: len(calls) == 2)
    took = timed(lambda: run_until_spent(run_once, budget, Items(), idle_seconds=30, wake=wake))
    assert took < PROMPT + 3 * STOP_POLL_SECONDS
    assert len(calls) == 2 and len(slices) == 3
    assert all(0 < s <= STOP_POLL_SECONDS for s in slices)

    def never_woken(seconds: float) -> bool:
        time.sleep(seconds)
        return False

    assert 0.12 <= timed(lambda: Budget().wait(0.12, never_woken)) < 0.12 + PROMPT


def test_a_stop_ends_an_idle_wait_and_the_loop_at_once() -> None:
    stop = threading.Event()
    run_once, calls = runs()

    def idle() -> float:
        stop.set()  # as a signal would, during the wait that follows
        return 30.0

    budget = Budget(30, stop.is_set)
    assert timed(lambda: run_until_spent(run_once, budget, Items(), idle_seconds=idle)) < PROMPT
    assert len(calls) == 1


def test_a_retryable_failure_is_recorded_and_backed_off_from_then_the_runs_go_on() -> None:
    recorded: list[Exception] = []
    run_once, calls = runs(ConnectionError("away"), [1])
    retry = Retry((ConnectionError,), recorded.append, backoff_seconds=0.05)
    total = Items()
    took = timed(
        lambda: run_until_spent(run_once, Budget(), total, idle_seconds=lambda: None, retry=retry)
    )
    assert [str(e) for e in recorded] == ["away"]
    assert (total.items, len(calls)) == ([1], 3)
    assert 0.05 <= took < PROMPT


def test_a_stop_ends_the_backoff_at_once() -> None:
    stop = threading.Event()
    run_once, calls = runs(ConnectionError("away"), [1])
    retry = Retry((ConnectionError,), lambda exc: stop.set(), backoff_seconds=30)
    budget = Budget(30, stop.is_set)
    took = timed(lambda: run_until_spent(run_once, budget, Items(), idle_seconds=0, retry=retry))
    assert took < PROMPT
    assert len(calls) == 1


@pytest.mark.parametrize("retry", [None, Retry((ConnectionError,), lambda exc: None)])
def test_any_other_failure_ends_the_loop_and_the_total_keeps_what_was_done(
    retry: Retry | None,
) -> None:
    run_once, _ = runs([1], ValueError("a bug"))
    total = Items()
    with pytest.raises(ValueError, match="a bug"):
        run_until_spent(run_once, Budget(), total, idle_seconds=0, retry=retry)
    assert total.items == [1]


def test_a_start_check_runs_every_check_and_names_every_failure_in_one_line() -> None:
    """Every service is checked even after one failed (an operator fixes all at once), the
    failures' first lines joined into one PinError naming the worker; a check that passes is not
    mentioned. Anything but a PinError is a bug, not a bad setting: it is raised as it came."""
    ran: list[str] = []

    def failing(name: str, message: str) -> Callable[[], None]:
        def check() -> None:
            ran.append(name)
            raise PinError(message)

        return check

    with pytest.raises(PinError) as raised:
        check_services(
            "the loader",
            [
                failing("clickhouse", "ClickHouse at h:9000: authentication failed\nstack"),
                lambda: ran.append("postgres"),
                failing("kafka", "Kafka at h:9092 is unreachable"),
            ],
        )
    assert ran == ["clickhouse", "postgres", "kafka"]
    assert str(raised.value) == (
        "the loader cannot start: ClickHouse at h:9000: authentication failed; "
        "Kafka at h:9092 is unreachable"
    )
    check_services("the loader", [lambda: None])  # nothing failed: nothing raised
    with pytest.raises(ZeroDivisionError):
        check_services("the loader", [lambda: 1 / 0])
