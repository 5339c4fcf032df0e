"""Shared by every domain's definitions: is a job already queued or running, is `pin serve`
stopping, the sensor that keeps a long-lived worker's run going, the one way the project
declares a schedule (of a job, or of a check alone), the ClickHouse pool and the id lists of
metadata."""

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import dagster as dg
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from pin_pipelines.config import Settings
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.errors import PinError
from pin_pipelines.quantiles import quantile
from pin_pipelines.signals import STOP_SIGNALS, stop_requested

IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


def in_flight_records(
    context: dg.SensorEvaluationContext, job_name: str, limit: int = 5
) -> list[dg.RunRecord]:
    return list(
        context.instance.get_run_records(
            dg.RunsFilter(job_name=job_name, statuses=IN_FLIGHT), limit=limit
        )
    )


#: A long-lived run's successor is launched at least this long before the run in flight ends,
#: and longer when launches are slow: the measured launch latency's p99 plus
#: HANDOVER_SLACK_SECONDS (`handover_seconds`). The successor waits (relay: on the relay lock;
#: loader: beside it, in the consumer group) for the rest. The launch latency does not hold the
#: sensor's own delay (a 5 s interval, evaluated late on a busy daemon): with 20 s, a successor
#: on a machine with every core busy started 0.8 s before its predecessor's end (test_handover).
HANDOVER_SECONDS = 30.0
HANDOVER_SLACK_SECONDS = 10.0
#: At most: the relay's successor waits on the relay lock meanwhile (its lock_timeout is 60 s).
MAX_HANDOVER_SECONDS = 50.0
#: The launches measured: a job's last runs that started.
LAUNCH_SAMPLE_RUNS = 20


def launch_latencies(instance: dg.DagsterInstance, job_name: str) -> list[float]:
    """Seconds from created to started (the daemon's dequeue, the code server's process start,
    the run worker's imports) of the job's last LAUNCH_SAMPLE_RUNS runs that started, sorted.
    Measured under `pin serve` on a busy 2-core machine: 13.7–19 s, beyond the fixed
    20 s margin's reach once the machine is busier."""
    records = instance.get_run_records(
        dg.RunsFilter(job_name=job_name), limit=LAUNCH_SAMPLE_RUNS * 2
    )
    started = [r for r in records if r.start_time is not None][:LAUNCH_SAMPLE_RUNS]
    return sorted(
        max(0.0, float(r.start_time or 0.0) - r.create_timestamp.timestamp()) for r in started
    )


def handover_seconds(latencies: list[float]) -> float:
    """How long before a long-lived run's end its successor is launched: the launch latency's
    p99 plus slack, so the successor is running before the run in flight ends (no gap in the
    relay's or the loader's leg), within [HANDOVER_SECONDS, MAX_HANDOVER_SECONDS]."""
    p99 = quantile(latencies, 0.99) or 0.0
    return min(MAX_HANDOVER_SECONDS, max(HANDOVER_SECONDS, p99 + HANDOVER_SLACK_SECONDS))


def budget_run_config(op: str, budget_seconds: float) -> dict[str, Any]:
    """The run config of a long-lived run whose op `op` runs `budget_seconds` (the sensors give
    PIN_LONG_RUN_SECONDS; a run launched by hand from the UI keeps its config's default)."""
    return {"ops": {op: {"config": {"budget_seconds": float(budget_seconds)}}}}


def ending_soon(record: dg.RunRecord, op: str, default_budget: float, margin: float) -> bool:
    """Whether a started long-lived run (its op `op` runs for `budget_seconds` of its config, or
    `default_budget`) ends within `margin` seconds: time for the sensor to launch its successor."""
    if record.start_time is None:
        return False
    run_config: dict[str, Any] = dict(record.dagster_run.run_config)
    op_config = run_config.get("ops", {}).get(op, {}).get("config", {})
    budget = float(op_config.get("budget_seconds", default_budget))
    return time.time() - record.start_time > budget - margin


Reading = TypeVar("Reading")
Decision = dg.RunRequest | dg.SkipReason


@dataclass(frozen=True)
class Backlog:
    """A long-lived worker's backlog as its sensor read it: the tags of the run it launches, and
    whether the backlog asks for one more run beside those in flight."""

    tags: dict[str, str]
    wants_more: bool = False


def worker_sensor(
    *,
    name: str,
    job: dg.JobDefinition | UnresolvedAssetJobDefinition,
    description: str,
    read: Callable[[Settings], Reading],
    unreadable: str,
    decide: Callable[[dg.SensorEvaluationContext, Settings, Reading], Decision],
    minimum_interval_seconds: int = 5,
) -> dg.SensorDefinition:
    """The one shape of the workers' sensors (drain, relay, loader; River's one service shape):
    on every tick, nothing while `pin serve` stops; `read` what the worker has to do (its queue,
    outbox or consumer lag), and nothing while that cannot be read, since a run would only fail
    on the same unreachable peer (`<unreadable>: <the error>`); then `decide` on a run. On from
    the start."""

    @dg.sensor(
        name=name,
        job=job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=description,
    )
    def tick(context: dg.SensorEvaluationContext, pin: PinSettings) -> Decision:
        if instance_stopping(context.instance):
            return dg.SkipReason(STOPPING_REASON)
        settings = pin.get()
        try:
            reading = read(settings)
        except PinError as exc:
            return dg.SkipReason(f"{unreadable}: {exc}")
        return decide(context, settings, reading)

    return tick


def long_run_sensor(
    *,
    name: str,
    job: dg.JobDefinition | UnresolvedAssetJobDefinition,
    op: str,
    noun: str,
    description: str,
    read_backlog: Callable[[Settings], Backlog],
    unreadable: str,
    max_runs: Callable[[Settings], int] = lambda _settings: 1,
) -> dg.SensorDefinition:
    """The sensor of a long-lived worker (the relay, the loader): it keeps one run of `job`
    going, whether work waits or not (the worker must be there when work comes); launches its
    successor `handover_seconds` before the run in flight ends (its op `op` runs for
    PIN_LONG_RUN_SECONDS); and launches more runs, up to `max_runs`, while the backlog wants
    them."""

    def decide(
        context: dg.SensorEvaluationContext, settings: Settings, backlog: Backlog
    ) -> Decision:
        limit = max_runs(settings)
        runs = in_flight_records(context, job.name, limit=limit + 1)
        budget = settings.long_run_seconds
        run_config = budget_run_config(op, budget)
        margin = handover_seconds(launch_latencies(context.instance, job.name))
        staying = [r for r in runs if not ending_soon(r, op, budget, margin)]
        if not staying:
            tags = backlog.tags
            if runs:  # every run in flight ends soon: its successor
                tags = {
                    **tags,
                    "pin/takes_over_from": runs[0].dagster_run.run_id,
                    "pin/handover_seconds": f"{margin:.1f}",
                }
            return dg.RunRequest(run_config=run_config, tags=tags)
        # Each more run costs its peers something (a loader: a rebalance), so one joins only
        # when the backlog asks. The run queue admits no more than the limit either
        # (dagster_instance.py).
        if len(staying) < limit and backlog.wants_more:
            return dg.RunRequest(run_config=run_config, tags=backlog.tags)
        return dg.SkipReason(f"{len(staying)} {noun}(s) already queued or running")

    return worker_sensor(
        name=name,
        job=job,
        description=description,
        read=read_backlog,
        unreadable=unreadable,
        decide=decide,
    )


#: `pin serve` writes this file into DAGSTER_HOME when it is asked to stop: sensors launch nothing
#: more and a drain ends after the project in hand, and `pin serve` stops the daemon only once no
#: run is in flight, so a clean stop leaves no run in FAILURE. Removed at each start.
STOPPING_MARKER = "pin-serve-stopping"
STOPPING_REASON = "pin serve is stopping: no new runs"


def instance_stopping(instance: dg.DagsterInstance) -> bool:
    return (Path(instance.root_directory) / STOPPING_MARKER).exists()


class RunStop:
    """When a long-lived op (drain, relay, load) should end, and how its run ends then.

    Dagster cancels a run by marking it CANCELING and interrupting its main thread (SIGINT;
    SIGTERM is mapped onto it), which raised DagsterExecutionInterruptedError wherever the op
    happened to be. The same signals also come without any cancel: Ctrl-C in `bin/up`'s
    terminal signals the whole foreground process group, and systemd's default stop every
    process of the unit, run workers included (every such stop used to leave the runs in
    FAILURE). So inside `stopped_by_signal` the signals only set a flag, polled with `pin
    serve`'s stopping marker; the op finishes its project or batch in hand and ends, and
    `end` then raises only when the run was canceled: a signal without a cancel is the
    instance stopping, and the run ends SUCCESS, as on the marker."""

    def __init__(self, context: dg.OpExecutionContext | dg.AssetExecutionContext) -> None:
        self._context = context
        self._signaled: Callable[[], bool] = lambda: False

    def requested(self) -> bool:
        return self._signaled() or instance_stopping(self._context.instance)

    def end(self) -> None:
        """After the op's work and its summary: a canceled run ends canceled."""
        if not self._signaled():
            return
        run = self._context.instance.get_run_by_id(self._context.run.run_id)
        if run is not None and run.status == dg.DagsterRunStatus.CANCELING:
            raise dg.DagsterExecutionInterruptedError()


@contextmanager
def stopped_by_signal(
    context: dg.OpExecutionContext | dg.AssetExecutionContext,
) -> Iterator[RunStop]:
    """SIGINT and SIGTERM as RunStop's flag while the block runs; the previous handlers come
    back afterwards. Off the main thread (no signal handlers there) only the marker counts, and
    a cancel interrupts as Dagster does."""
    stop = RunStop(context)
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        stop._signaled = stop_requested()
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def running_schedule(
    *,
    job: dg.JobDefinition | UnresolvedAssetJobDefinition,
    cron: str,
    description: str,
    name: str | None = None,
) -> dg.ScheduleDefinition:
    """A schedule of the project: on from the start (UTC), and launching nothing while `pin serve`
    stops. Without a name, Dagster names it `<job>_schedule`."""
    return dg.ScheduleDefinition(
        name=name,
        job=job,
        cron_schedule=cron,
        execution_timezone="UTC",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description=description,
        should_execute=lambda context: not instance_stopping(context.instance),
    )


def check_schedule(
    check: dg.AssetChecksDefinition,
    *,
    job_name: str,
    cron: str,
    description: str,
    name: str | None = None,
) -> dg.ScheduleDefinition:
    """A running_schedule of a job `job_name` that evaluates `check` alone: a check that must
    also run when no materialization does (Definitions picks the job up from the schedule)."""
    return running_schedule(
        name=name,
        job=dg.define_asset_job(
            job_name, selection=dg.AssetSelection.checks(check), description=description
        ),
        cron=cron,
        description=description,
    )


#: The embedded ClickHouse engine admits one process per data folder; dagster.yaml limits every
#: pool to one op at a time. The continuous loader is not in it: it owns the folder and answers
#: the others (clickhouse/owner.py). The ops in it (the versions check, the drift asset, the
#: backfill) then go through the loader; while none runs, they take turns instead of one of them
#: finding the folder busy.
CLICKHOUSE_POOL = "clickhouse"

#: Ids listed in metadata, ready to paste into a job's config (force_recalc_job's project_ids).
LISTED_IDS = 200


def id_list(ids: list[Any]) -> dg.MetadataValue:
    """The first LISTED_IDS ids as a JSON list of strings."""
    return dg.MetadataValue.json([str(i) for i in ids[:LISTED_IDS]])
