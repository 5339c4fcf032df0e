"""The one shape of the workers' sensors (drain, relay, loader): nothing launched while `pin
serve` stops or while the worker's backlog cannot be read; a long-lived worker's run kept going,
its successor launched before it ends (defs/handover.py).

A tick runs every 5 seconds, all day, mostly to find nothing to do: it reads only what its
decision needs (docs/benchmarks.md, "At rest"). The drain's sensor reads its queue on every tick
(one statement: the spec's tick and its liveness beat); a long-lived worker's sensor reads its
backlog only when it would launch a run, and the launch latencies only when a run nears its end."""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import dagster as dg
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from pin_pipelines.config import Settings
from pin_pipelines.defs.handover import (
    MAX_HANDOVER_SECONDS,
    handover_seconds,
    launch_latencies,
)
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.defs.stopping import STOPPING_REASON, instance_stopping
from pin_pipelines.errors import PinError

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
    decide: Callable[[dg.SensorEvaluationContext, Settings, Callable[[], Reading]], Decision],
    minimum_interval_seconds: int = 5,
) -> dg.SensorDefinition:
    """The one shape of the workers' sensors (drain, relay, loader; River's one service shape):
    on every tick, nothing while `pin serve` stops; then `decide` on a run, calling `read` (what
    the worker has to do: its queue, outbox or consumer lag) when the decision needs it, and
    nothing while that cannot be read, since a run would only fail on the same unreachable peer
    (`<unreadable>: <the error>`). On from the start."""

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
            return decide(context, settings, lambda: read(settings))
        except PinError as exc:  # raised by `read`: the rest of a decision reads no peer
            return dg.SkipReason(f"{unreadable}: {exc}")

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
        context: dg.SensorEvaluationContext, settings: Settings, backlog: Callable[[], Backlog]
    ) -> Decision:
        limit = max_runs(settings)
        runs = in_flight_records(context, job.name, limit=limit + 1)
        budget = settings.long_run_seconds
        run_config = budget_run_config(op, budget)
        # The launch latencies (a query of the run storage) only matter to a run that may end
        # within the longest margin; the others stay whatever the margin.
        near_end = any(ending_soon(r, op, budget, MAX_HANDOVER_SECONDS) for r in runs)
        margin = (
            handover_seconds(launch_latencies(context.instance, job.name))
            if near_end
            else MAX_HANDOVER_SECONDS
        )
        staying = [r for r in runs if not ending_soon(r, op, budget, margin)]
        if not staying:
            tags = backlog().tags
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
        if len(staying) < limit and (more := backlog()).wants_more:
            return dg.RunRequest(run_config=run_config, tags=more.tags)
        return dg.SkipReason(f"{len(staying)} {noun}(s) already queued or running")

    return worker_sensor(
        name=name,
        job=job,
        description=description,
        read=read_backlog,
        unreadable=unreadable,
        decide=decide,
    )
