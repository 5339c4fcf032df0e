"""Drift reconciliation: denormalized aggregates against their source rows, and the
dev-stats dimension against chessboard.layout_groups; repair goes through the normal pipeline
(recalc queue, outbox → Kafka → loader), never by writing the derived values directly.

Plain Python + SQL; the Dagster assets (pin_pipelines/defs/reconcile) and `pin reconcile` call in.
"""

from pin_pipelines.reconcile.aggregates import AggregateDrift, aggregates_drift, enqueue_projects
from pin_pipelines.reconcile.dimension import (
    DimDrift,
    Snapshot,
    VersionsBehind,
    compare,
    dim_layout_group_drift,
    republish_layout_groups,
    versions_behind,
)
from pin_pipelines.reconcile.model import DriftRow, worst
from pin_pipelines.reconcile.report import (
    ReconcileReport,
    Repair,
    reconcile,
    repair_aggregates,
    repair_dim,
)

__all__ = [
    "AggregateDrift",
    "DimDrift",
    "DriftRow",
    "ReconcileReport",
    "Repair",
    "Snapshot",
    "VersionsBehind",
    "aggregates_drift",
    "compare",
    "dim_layout_group_drift",
    "enqueue_projects",
    "reconcile",
    "repair_aggregates",
    "repair_dim",
    "republish_layout_groups",
    "versions_behind",
    "worst",
]
