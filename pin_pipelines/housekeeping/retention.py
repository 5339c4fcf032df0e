"""Retention of finished Dagster runs: the instance's only unbounded growth.

A 5-second sensor launches thousands of runs a day, and nothing in Dagster deletes runs, their
event logs or their compute logs (`retention:` in dagster.yaml covers sensor and schedule ticks
only). This deletes finished runs past their retention through Dagster's own instance API
(`delete_run` removes the run and its event log; the compute log manager removes its captured
stdout/stderr), in batches and with a bound per call, so it never holds the instance for long
and a backlog is worked off over several calls. Queued, starting, started and canceling runs are
never selected: only SUCCESS, FAILURE and CANCELED runs are.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
from dagster._core.storage.event_log.schema import SqlEventLogStorageTable
from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage
from dagster._core.storage.local_compute_log_manager import LocalComputeLogManager
from sqlalchemy import func, select

from pin_pipelines.config import Settings

#: Finished statuses, each with the policy field that keeps it.
FINISHED = (
    ("success_days", (dg.DagsterRunStatus.SUCCESS,)),
    ("failure_days", (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)),
)


@dataclass(frozen=True)
class RetentionPolicy:
    """How long finished runs are kept, and how much one call may delete."""

    success_days: float = 3.0
    #: Failed and canceled runs: kept longer, they are what on-call looks back at.
    failure_days: float = 14.0
    #: Runs deleted by one call at most; the rest waits for the next (the job runs daily).
    max_runs: int = 5000
    #: Runs looked up and deleted per round trip.
    batch_size: int = 100

    @classmethod
    def from_settings(cls, settings: Settings) -> RetentionPolicy:
        return cls(
            success_days=settings.dagster_retention_success_days,
            failure_days=settings.dagster_retention_failure_days,
        )


@dataclass
class PruneSummary:
    dry_run: bool
    runs: int = 0
    runs_by_status: dict[str, int] = field(default_factory=dict)
    #: Event-log rows and their bytes (None when the event storage is not SQL).
    events: int | None = 0
    event_bytes: int | None = 0
    #: Captured stdout/stderr bytes (None when the compute logs are not on a local disk).
    compute_log_bytes: int | None = 0
    #: Finished runs past retention were left for the next call (the per-call bound).
    more_left: bool = False

    @property
    def bytes_freed(self) -> int:
        return (self.event_bytes or 0) + (self.compute_log_bytes or 0)

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "bytes_freed": self.bytes_freed}


def prune_runs(
    instance: dg.DagsterInstance,
    policy: RetentionPolicy,
    *,
    dry_run: bool = False,
    now: datetime | None = None,
) -> PruneSummary:
    """Delete finished runs older than the policy, at most `policy.max_runs` per call; with
    `dry_run`, count all of them and delete nothing."""
    summary = PruneSummary(dry_run=dry_run)
    now = now or datetime.now(UTC)
    budget = policy.max_runs
    for filters in _past_retention(policy, now):
        cursor: str | None = None
        while dry_run or budget > 0:
            limit = policy.batch_size if dry_run else min(policy.batch_size, budget)
            records = instance.get_run_records(filters=filters, limit=limit, cursor=cursor)
            run_ids = [r.dagster_run.run_id for r in records]
            if not run_ids:
                break
            _count(instance, run_ids, summary)
            for record in records:
                status = record.dagster_run.status.value
                summary.runs_by_status[status] = summary.runs_by_status.get(status, 0) + 1
            summary.runs += len(run_ids)
            if dry_run:
                cursor = run_ids[-1]  # nothing is deleted: page on
                continue
            for run_id in run_ids:
                instance.delete_run(run_id)
                instance.compute_log_manager.delete_logs(prefix=[run_id])
            budget -= len(run_ids)
    if not dry_run and budget <= 0:
        summary.more_left = any(
            instance.get_run_records(filters=filters, limit=1)
            for filters in _past_retention(policy, now)
        )
    return summary


def _past_retention(policy: RetentionPolicy, now: datetime) -> list[dg.RunsFilter]:
    return [
        dg.RunsFilter(
            statuses=list(statuses),
            updated_before=now - timedelta(days=getattr(policy, days_field)),
        )
        for days_field, statuses in FINISHED
    ]


def _count(instance: dg.DagsterInstance, run_ids: Sequence[str], summary: PruneSummary) -> None:
    storage = instance.event_log_storage
    if isinstance(storage, SqlEventLogStorage) and summary.events is not None:
        table = SqlEventLogStorageTable
        query = select(func.count(), func.coalesce(func.sum(func.length(table.c.event)), 0)).where(
            table.c.run_id.in_(run_ids)
        )
        with storage.index_connection() as conn:
            events, size = conn.execute(query).one()
        summary.events = (summary.events or 0) + int(events)
        summary.event_bytes = (summary.event_bytes or 0) + int(size)
    else:
        summary.events = summary.event_bytes = None
    manager = instance.compute_log_manager
    if isinstance(manager, LocalComputeLogManager) and summary.compute_log_bytes is not None:
        # A run's captured logs are the folder <base_dir>/<run_id> (its log keys' prefix);
        # the manager has no public accessor for its folder.
        base = Path(manager._base_dir)
        summary.compute_log_bytes += sum(_folder_bytes(base / run_id) for run_id in run_ids)
    else:
        summary.compute_log_bytes = None


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        total += sum((Path(root) / name).stat().st_size for name in files)
    return total
