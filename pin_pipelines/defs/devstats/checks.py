"""The asset checks of dim_layout_group: the spec's freshness SLA (≤ 5 minutes from event to
visibility), seen from the topic and from the source rows."""

import dagster as dg

from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.defs.devstats.assets import dim_layout_group
from pin_pipelines.defs.devstats.freshness import dim_layout_group_freshness_check
from pin_pipelines.defs.metadata import id_list
from pin_pipelines.defs.pools import CLICKHOUSE_POOL
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.defs.schedules import check_schedule
from pin_pipelines.devstats.loading import FRESHNESS_SLA_SECONDS, unloaded_events
from pin_pipelines.reconcile import versions_behind


@dg.asset_check(
    asset=dim_layout_group,
    description=(
        "Fails when an event not loaded yet was created (its outbox row: the message's "
        "timestamp) longer ago than the 5-minute SLA."
    ),
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


#: The check also runs on its own, every 5 minutes (the SLA): as a step of the load run it is
#: skipped whenever the load fails (ClickHouse down) and never runs when no load is launched,
#: which are exactly the times the SLA is at risk. Not every minute: a run per minute per check
#: was a quarter of the instance's storage (bench/bench_dagster_storage.py). Dagster's own
#: freshness check of the asset (freshness.py) has the same SLA and cadence, so it shares the run.
dim_layout_group_fresh_schedule = check_schedule(
    dim_layout_group_fresh,
    dim_layout_group_freshness_check,
    job_name="dim_layout_group_fresh_check_job",
    name="dim_layout_group_fresh_schedule",
    cron="*/5 * * * *",
    description=(
        "Evaluates the freshness SLA every 5 minutes, also while loads fail or stop: from the "
        "topic (dim_layout_group_fresh) and as Dagster's freshness of the asset (freshness_check)."
    ),
)


@dg.asset_check(
    asset=dim_layout_group,
    pool=CLICKHOUSE_POOL,
    description=(
        "Fails when a row's SourceVersion is behind chessboard.layout_groups longer than the "
        "5-minute SLA after the group changed; groups without a row are counted."
    ),
)
def dim_layout_group_versions_current(pin: PinSettings) -> dg.AssetCheckResult:
    settings = pin.get()
    with open_clickhouse(
        settings.clickhouse_url, password_file=settings.clickhouse_password_file
    ) as ch:
        found = versions_behind(settings.pg_dsn, ch, FRESHNESS_SLA_SECONDS)
    late = found.stale_overdue
    missing_late = found.missing_overdue
    problems = [f"{len(late)} row(s) behind the source past the SLA"] if late else []
    if missing_late:
        problems.append(f"{len(missing_late)} group(s) without a row past the SLA")
    return dg.AssetCheckResult(
        passed=not problems,
        description=(
            "; ".join(problems) + ": check the relay and the loader runs, then materialize "
            "dim_layout_group_drift with repair: true"
            if problems
            else None
        ),
        metadata={
            "groups_checked": found.checked,
            "rows_behind": len(found.stale),
            "rows_behind_past_sla": len(late),
            "behind_past_sla_ids": id_list(late),
            # A group is published once it exists, so one without a row past the SLA
            # is as late as a stale row; dim_layout_group_drift's repair publishes it.
            "groups_missing": len(found.missing),
            "groups_missing_past_sla": len(missing_late),
            "missing_past_sla_ids": id_list(missing_late),
            "sla_seconds": FRESHNESS_SLA_SECONDS,
        },
    )


#: It reads every group from PostgreSQL and ClickHouse, so it runs every 10 minutes on its own,
#: not with each load run.
dim_layout_group_versions_schedule = check_schedule(
    dim_layout_group_versions_current,
    job_name="dim_layout_group_versions_check_job",
    name="dim_layout_group_versions_schedule",
    cron="*/10 * * * *",
    description="Compares the dimension's versions with chessboard.layout_groups every 10 minutes.",
)
