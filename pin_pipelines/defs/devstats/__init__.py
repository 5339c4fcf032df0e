"""Spec 003 in Dagster: the dim_layout_group asset, its checks, sensor and backfill job."""

import dagster as dg

from pin_pipelines.defs.devstats.assets import dim_layout_group
from pin_pipelines.defs.devstats.checks import (
    dim_layout_group_fresh,
    dim_layout_group_fresh_schedule,
    dim_layout_group_versions_current,
    dim_layout_group_versions_schedule,
)
from pin_pipelines.defs.devstats.freshness import (
    dim_layout_group_freshness_check,
    dim_layout_group_last_update_sensor,
)
from pin_pipelines.defs.devstats.jobs import dim_layout_group_backfill_job, dim_layout_group_job
from pin_pipelines.defs.devstats.sensors import dim_layout_group_sensor

defs = dg.Definitions(
    assets=[dim_layout_group],
    asset_checks=[
        dim_layout_group_fresh,
        dim_layout_group_versions_current,
        dim_layout_group_freshness_check,
    ],
    jobs=[dim_layout_group_job, dim_layout_group_backfill_job],
    sensors=[
        dim_layout_group_sensor,
        dim_layout_group_last_update_sensor,
    ],
    schedules=[
        dim_layout_group_fresh_schedule,
        dim_layout_group_versions_schedule,
    ],
)
