"""One shape for the long-lived workers (the recalc drain, the outbox relay, the dimension
loader): a budget that says when to stop, a summary that merges run after run, and one
batch-and-backoff loop.

Each worker used to carry its own deadline arithmetic, interruptible sleep and accumulation; they
differed in small ways (one slept through a stop, another woke within 50 ms), and the differences
were accidents, not decisions. Plain Python: `pin` and the Dagster ops call the same loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, Self, TypeVar

from pin_pipelines.errors import PinError, first_line

#: How often a wait looks at the stop flag: a stop (a signal handler's flag, a Dagster run's
#: termination) is obeyed within this, while a wait costs no measurable CPU.
STOP_POLL_SECONDS = 0.05


#: Waits up to the given seconds for work to arrive (a notification); True when it did.
Wake = Callable[[float], bool]


def never() -> bool:
    """The stop flag of a worker nobody stops: it ends with its budget, or when idle."""
    return False


class Budget:
    """When a worker stops: `seconds` from its creation (`math.inf`: never by time) or as soon
    as `should_stop()` holds, whichever comes first.

    Time and the stop are asked together because every caller needs both and the `or` of them
    was written out in each worker; `should_stop` is called often, so it must be cheap (a flag).
    """

    def __init__(self, seconds: float = math.inf, should_stop: Callable[[], bool] = never) -> None:
        self.deadline = time.monotonic() + seconds
        self.should_stop = should_stop

    def stopping(self) -> bool:
        """A stop was asked or the time is up: the work in hand finishes, no new work starts.
        Usable wherever a worker takes a `should_stop` callable."""
        return self.should_stop() or time.monotonic() >= self.deadline

    def remaining(self) -> float:
        """Seconds left (never below 0; `math.inf` for a budget without a deadline)."""
        return max(0.0, self.deadline - time.monotonic())

    def wait(self, seconds: float, wake: Wake | None = None) -> None:
        """Sleep up to `seconds`, returning early when the budget ends and within
        STOP_POLL_SECONDS of a stop: an idle worker must not hold up a deploy's SIGTERM. With
        `wake`, the sleep is `wake`'s wait for something to do, and ends when it says so."""
        until = min(time.monotonic() + seconds, self.deadline)
        while not self.should_stop() and (left := until - time.monotonic()) > 0:
            if wake is None:
                time.sleep(min(left, STOP_POLL_SECONDS))
            elif wake(min(left, STOP_POLL_SECONDS)):
                return


def check_services(worker: str, checks: Sequence[Callable[[], object]]) -> None:
    """A worker's start: reach every service it will need, whether or not there is work yet, so
    a wrong password or address fails the start, not the first event hours later (a load that
    found nothing new reported `complete` while it could not write). Each check is bounded by
    its client's own timeouts and raises a PinError naming its service and the cause; every
    check runs, and the failures are one line: `<worker> cannot start: <service: cause>; …`."""
    failures = []
    for check in checks:
        try:
            check()
        except PinError as exc:
            failures.append(first_line(exc))
    if failures:
        raise PinError(f"{worker} cannot start: {'; '.join(failures)}")


class Mergeable(Protocol):
    """What a worker's run reports, in a shape that adds up: a run of many runs reports one
    summary of the same type (a Dagster run's metadata, the CLI's JSON line)."""

    def merge(self, later: Self) -> None:
        """Fold a later run's summary into this one: counts add up, states (a backlog, the last
        error) are the later run's."""
        ...

    @property
    def found_work(self) -> bool:
        """Whether the run did anything: a run that found nothing to do is followed by an idle
        wait, one that did is followed by the next run at once (more may be waiting)."""
        ...


S = TypeVar("S", bound=Mergeable)


@dataclass(frozen=True)
class Retry:
    """The failures a worker resumes from (a broker or database away: the next run works once
    it is back), how it records one (log it, count it in its summary) and how long it backs off
    before the next run. One value, so no loop retries a failure nobody records."""

    errors: tuple[type[Exception], ...]
    record: Callable[[Exception], None]
    backoff_seconds: float = 1.0


def run_until_spent(
    run_once: Callable[[], S],
    budget: Budget,
    total: S,
    *,
    idle_seconds: float | Callable[[], float | None],
    retry: Retry | None = None,
    wake: Wake | None = None,
) -> S:
    """Repeat `run_once` until `budget` is spent or a stop is asked; returns `total` with every
    run's summary merged into it as it goes (a caller that keeps `total` still has what was done
    when a run raises).

    Stop and time are checked between runs only: `run_once` gets its stop from the budget
    itself (`budget.stopping`) and finishes the work in hand first.

    - A run that found nothing to do is followed by a wait of `idle_seconds`; a callable is
      asked after each such run, and its None ends the loop: a worker that runs until idle
      (the drain waits for a row about to fall due, and ends when none is).
    - With `wake`, that wait ends as soon as `wake` says work arrived: `idle_seconds` is then
      a backstop, the longest an idle worker goes without a run.
    - A run raising one of `retry.errors` is recorded (`retry.record`) and the next run starts
      after `retry.backoff_seconds`. Any other exception, or any at all without `retry`, ends
      the loop.
    """
    while not budget.stopping():
        try:
            summary = run_once()
        except Exception as exc:
            if retry is None or not isinstance(exc, retry.errors):
                raise
            retry.record(exc)
            budget.wait(retry.backoff_seconds)
            continue
        total.merge(summary)
        if summary.found_work:
            continue  # more may be waiting already
        pause = idle_seconds() if callable(idle_seconds) else idle_seconds
        if pause is None:
            break
        budget.wait(pause, wake)
    return total
