"""Tags of the runs whose concurrency a setting caps. The jobs carry them (defs/), and the run
queue of the instance that `pin serve` prepares limits runs by them (dagster_instance.py): kept
here, outside the Dagster wiring, so that the core never imports defs/."""

#: recalc_drain_job, capped by PIN_RECALC_MAX_DRAIN_RUNS.
DRAIN_JOB_TAGS = {"pin/job": "recalc_drain"}
#: The dim_layout_group loads and the backfill, capped by PIN_DEVSTATS_MAX_LOAD_RUNS.
DEVSTATS_JOB_TAGS = {"pin/job": "devstats_load"}
