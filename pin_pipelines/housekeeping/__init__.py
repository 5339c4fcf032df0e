"""Housekeeping of the Dagster instance: retention of finished runs."""

from pin_pipelines.housekeeping.retention import PruneSummary, RetentionPolicy, prune_runs

__all__ = ["PruneSummary", "RetentionPolicy", "prune_runs"]
