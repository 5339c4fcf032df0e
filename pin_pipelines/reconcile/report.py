"""`pin reconcile [--repair]`: both checks, the optional repair, one summary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.config import Settings
from pin_pipelines.reconcile.aggregates import AggregateDrift, aggregates_drift, enqueue_projects
from pin_pipelines.reconcile.dimension import (
    DimDrift,
    clear_events_beyond_source,
    dim_layout_group_drift,
    republish_layout_groups,
)
from pin_pipelines.reconcile.model import worst


@dataclass(frozen=True)
class Repair:
    """What a repair did; the drift it found heals once drain → relay → loader have run."""

    projects_enqueued: int
    layout_groups_republished: int

    def as_dict(self) -> dict[str, int]:
        return {
            "projects_enqueued": self.projects_enqueued,
            "layout_groups_republished": self.layout_groups_republished,
        }


@dataclass(frozen=True)
class ReconcileReport:
    aggregates: AggregateDrift
    dim: DimDrift
    repair: Repair | None = None

    def as_dict(self) -> dict[str, Any]:
        """The CLI's JSON summary: the contract's four counts first, then the details."""
        aggregates, dim = self.aggregates.summary(), self.dim.summary()
        return {
            "projects_checked": aggregates.pop("projects_checked"),
            "projects_drifted": aggregates.pop("projects_drifted"),
            "dim_rows_checked": dim.pop("dim_rows_checked"),
            "dim_rows_drifted": dim.pop("dim_rows_drifted"),
            **aggregates,
            **dim,
            "repaired": None if self.repair is None else self.repair.as_dict(),
            "worst": [row.as_dict() for row in worst(self.aggregates.rows + self.dim.rows, 10)],
        }


def repair_aggregates(pg_dsn: str, drift: AggregateDrift) -> int:
    """Every drifted project due now (queued ones too: their debounce may still be running)."""
    return enqueue_projects(pg_dsn, drift.project_ids)


def repair_dim(pg_dsn: str, drift: DimDrift) -> int:
    """Drifted groups re-published; what the relay recorded beyond the source is then cleared."""
    written = republish_layout_groups(pg_dsn, drift)
    clear_events_beyond_source(pg_dsn, drift)
    return written


def reconcile(settings: Settings, repair: bool = False) -> ReconcileReport:
    aggregates = aggregates_drift(settings.pg_dsn)
    with open_clickhouse(
        settings.clickhouse_url, password_file=settings.clickhouse_password_file
    ) as ch:
        dim = dim_layout_group_drift(settings.pg_dsn, ch)
    done = None
    if repair:
        done = Repair(
            repair_aggregates(settings.pg_dsn, aggregates), repair_dim(settings.pg_dsn, dim)
        )
    return ReconcileReport(aggregates, dim, done)
