"""Spec 000 in Dagster: the 5-second queue sensor, the drain job and the runbook jobs."""

import dagster as dg

from pin_pipelines.defs.recalc.assets import chessboard_aggregates, chessboard_sources
from pin_pipelines.defs.recalc.checks import no_poisoned_recalc_requests, poison_check_schedule
from pin_pipelines.defs.recalc.jobs import force_recalc_job, recalc_drain_job, requeue_poisoned_job
from pin_pipelines.defs.recalc.sensors import recalc_queue_sensor

defs = dg.Definitions(
    assets=[*chessboard_sources, chessboard_aggregates],
    asset_checks=[no_poisoned_recalc_requests],
    jobs=[recalc_drain_job, force_recalc_job, requeue_poisoned_job],
    sensors=[recalc_queue_sensor],
    schedules=[poison_check_schedule],
)
