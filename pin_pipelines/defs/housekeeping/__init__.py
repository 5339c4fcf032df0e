"""Housekeeping of the Dagster instance itself."""

import dagster as dg

from pin_pipelines.defs.housekeeping.jobs import dagster_retention_job, dagster_retention_schedule

defs = dg.Definitions(jobs=[dagster_retention_job], schedules=[dagster_retention_schedule])
