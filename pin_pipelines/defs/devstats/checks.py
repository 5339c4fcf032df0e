"""The spec's freshness SLA (≤ 5 minutes from event to visibility) as an asset check."""

import dagster as dg

from pin_pipelines.defs.devstats.assets import dim_layout_group
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.devstats.freshness import FRESHNESS_SLA_SECONDS, unloaded_events


@dg.asset_check(
    asset=dim_layout_group,
    description="Fails when an event has waited in the topic longer than the 5-minute SLA.",
)
def dim_layout_group_fresh(pin: PinSettings) -> dg.AssetCheckResult:
    lag = unloaded_events(pin.get())
    oldest = lag.oldest_age_seconds
    return dg.AssetCheckResult(
        passed=oldest is None or oldest <= FRESHNESS_SLA_SECONDS,
        metadata={
            "unloaded_events": lag.events,
            "oldest_unloaded_age_seconds": oldest if oldest is not None else 0.0,
            "sla_seconds": FRESHNESS_SLA_SECONDS,
        },
    )


#: The check also runs on its own, every minute: as a step of the load run it is skipped whenever
#: the load fails (ClickHouse down) and never runs when no load is launched, which are exactly
#: the times the SLA is at risk.
dim_layout_group_fresh_job = dg.define_asset_job(
    "dim_layout_group_fresh_check_job",
    selection=dg.AssetSelection.checks(dim_layout_group_fresh),
    description="Evaluates dim_layout_group_fresh (scheduled every minute).",
)

dim_layout_group_fresh_schedule = dg.ScheduleDefinition(
    name="dim_layout_group_fresh_schedule",
    job=dim_layout_group_fresh_job,
    cron_schedule="* * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Evaluates the freshness SLA every minute, also while loads fail or stop.",
)
