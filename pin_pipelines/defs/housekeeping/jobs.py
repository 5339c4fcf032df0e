"""The retention of finished runs as a daily job (shipped on), and by hand from the launchpad."""

import dagster as dg

from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.defs.schedules import running_schedule
from pin_pipelines.housekeeping import RetentionPolicy, prune_runs


class PruneConfig(dg.Config):
    dry_run: bool = False


@dg.op
def prune_finished_runs(
    context: dg.OpExecutionContext, config: PruneConfig, pin: PinSettings
) -> None:
    """Deletes finished runs past retention with their event and compute logs (bounded per
    run: what is left is taken by the next one)."""
    policy = RetentionPolicy.from_settings(pin.get())
    summary = prune_runs(context.instance, policy, dry_run=config.dry_run)
    context.log.info(f"dagster retention: {summary.as_dict()}")


@dg.job(description="Delete finished runs past retention with their event and compute logs.")
def dagster_retention_job() -> None:
    prune_finished_runs()


dagster_retention_schedule = running_schedule(
    name="dagster_retention_schedule",
    job=dagster_retention_job,
    cron="17 3 * * *",  # daily, off the hour
    description="Keeps the Dagster instance bounded: PIN_DAGSTER_RETENTION_*_DAYS.",
)
