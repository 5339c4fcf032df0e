"""The drain job and the runbook's operator jobs (launchable from the launchpad)."""

from uuid import UUID

import dagster as dg

from pin_pipelines.defs.resources import CHESSBOARD_AGGREGATES, PinSettings
from pin_pipelines.defs.stopping import stopped_by_signal
from pin_pipelines.recalc import (
    RecalcReason,
    drain_until_idle,
    force_recalc,
    requeue_poisoned,
)
from pin_pipelines.run_tags import DRAIN_JOB_TAGS


class DrainConfig(dg.Config):
    #: A run drains tick after tick for up to two minutes: fewer, longer runs keep the instance
    #: small (each run costs ~20 event-log rows) and save launches; the sensor launches the
    #: successor shortly before the budget ends.
    budget_seconds: float = 120.0


@dg.op(tags={"kind": "postgres"})
def drain_recalc_queue(
    context: dg.OpExecutionContext, config: DrainConfig, pin: PinSettings
) -> None:
    """Drain due rows tick after tick until the queue is idle or the budget is spent."""
    # A stop (the run terminated, `pin serve` stopping, a stop signal) ends the drain after the
    # project in hand, which commits or rolls back whole; the rest stays queued (the spec's
    # cancellation rule). Per-project lines go to the run's stdout; the event log gets the
    # summary below.
    with stopped_by_signal(context) as stop:
        run = drain_until_idle(
            pin.get().pg_dsn,
            budget_seconds=config.budget_seconds,
            correlation_prefix=context.run_id,
            should_stop=stop.requested,
        )
    summary, metadata = run.as_dict(), run.metadata()
    context.log.info(f"drain summary: {summary}")
    if summary["processed"] or summary["skipped_archived"]:
        context.log_event(
            dg.AssetMaterialization(asset_key=CHESSBOARD_AGGREGATES, metadata=metadata)
        )
    else:
        context.log_event(dg.AssetObservation(asset_key=CHESSBOARD_AGGREGATES, metadata=metadata))
    if run.newly_poisoned:  # once, by the run that parked them; the check keeps showing them
        ids = [str(p) for p in run.newly_poisoned]
        context.log.error(
            f"CHESSBOARD_RECALC_POISON: {len(ids)} project(s) parked after repeated failures"
            f" in this run: {ids} ({run.poisoned} parked in all); see the"
            " no_poisoned_recalc_requests check and run requeue_poisoned_job"
        )
    stop.end()


@dg.job(tags=DRAIN_JOB_TAGS, description="Drain due project_recalc_requests (spec 000).")
def recalc_drain_job() -> None:
    drain_recalc_queue()


class ProjectIdsConfig(dg.Config):
    project_ids: list[str]
    reason: str = RecalcReason.MANUAL.value


def _parse_ids(raw: list[str]) -> list[UUID]:
    try:
        return [UUID(value) for value in raw]
    except ValueError as exc:
        raise dg.Failure(f"project_ids must be UUIDs: {exc}") from exc


@dg.op
def force_recalc_projects(
    context: dg.OpExecutionContext, config: ProjectIdsConfig, pin: PinSettings
) -> None:
    """Runbook "ручной форс-пересчёт": the projects' queue rows become due now."""
    try:
        reason = RecalcReason(config.reason)
    except ValueError:
        raise dg.Failure(f"reason must be one of {[r.value for r in RecalcReason]}") from None
    for project_id in _parse_ids(config.project_ids):
        force_recalc(pin.get().pg_dsn, project_id, reason)
        context.log.info(f"force-recalc requested for {project_id}")


@dg.job(description="Force-recalc projects now (config: project_ids).")
def force_recalc_job() -> None:
    force_recalc_projects()


class RequeueConfig(dg.Config):
    project_ids: list[str]


@dg.op
def requeue_poisoned_projects(
    context: dg.OpExecutionContext, config: RequeueConfig, pin: PinSettings
) -> None:
    """Runbook for poison rows, after the cause is fixed: reset attempts, due now."""
    for project_id in _parse_ids(config.project_ids):
        requeue_poisoned(pin.get().pg_dsn, project_id)
        context.log.info(f"requeued {project_id}")


@dg.job(description="Requeue poisoned recalc rows after triage (config: project_ids).")
def requeue_poisoned_job() -> None:
    requeue_poisoned_projects()
