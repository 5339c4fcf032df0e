"""Drift reconciliation in Dagster: the drift assets with their checks, an on-demand job and an
hourly run."""

import dagster as dg

from pin_pipelines.defs.reconcile.assets import aggregates_drift, dim_layout_group_drift
from pin_pipelines.defs.schedules import running_schedule

reconcile_job = dg.define_asset_job(
    "reconcile_job",
    selection=dg.AssetSelection.assets(aggregates_drift, dim_layout_group_drift),
    description="Both drift checks (launchpad: ops.<asset>.config.repair: true to repair).",
)

#: Drift is silent by nature: an hourly check makes it show up as a failed check, not a complaint.
reconcile_schedule = running_schedule(
    job=reconcile_job, cron="17 * * * *", description="Reports drift hourly (no repair)."
)

defs = dg.Definitions(
    assets=[aggregates_drift, dim_layout_group_drift],
    jobs=[reconcile_job],
    schedules=[reconcile_schedule],
)
