"""The drain's counters, written where it counts: named queries of `recalc.sql` run on the
drain's connection, inside its transaction, so a rolled-back project counts nothing, a committed
one exactly once, and the count survives the process. The exporter (`pin_pipelines.metrics`)
only reads them, with the label values below."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import psycopg

from pin_pipelines.db import queries

Q: Any = queries("recalc")

#: The drain's outcomes as `chessboard_recalc_runs_total{result}` values; "error" is the spec's
#: name for a failed run (alert "рост runs_total{result=error}"). An interrupted attempt was
#: given back, so it is not a run.
RESULT_LABELS: dict[str, str] = {
    "recalculated": "success",
    "skipped_archived": "skipped_archived",
    "failed": "error",
    "deferred": "deferred",
}
#: `chessboard_recalc_republished_total{entity}` values: the drain's republished keys.
ENTITIES = ("project", "layout", "layout_group")


class Counted(Protocol):
    """What a count needs of the drain's `ProjectResult` (a protocol, so the drain imports its
    counters and not the other way round)."""

    @property
    def outcome(self) -> str: ...
    @property
    def duration_seconds(self) -> float: ...
    @property
    def requested_count(self) -> int: ...
    @property
    def republished(self) -> Mapping[str, int]: ...


def record_outcome(conn: psycopg.Connection, result: Counted) -> None:
    """Count one claimed project. A deferred project (row lock held elsewhere) is counted as a
    run but not observed in the duration histogram: its time is lock waiting, not the recalc
    whose p99 the SLO bounds."""
    Q.record_recalc_outcome(
        conn,
        result=RESULT_LABELS[result.outcome],
        duration=None if result.outcome == "deferred" else result.duration_seconds,
        coalesced=result.requested_count,
        **{entity: result.republished.get(entity, 0) for entity in ENTITIES},
    )


def record_tick(conn: psycopg.Connection) -> None:
    """Worker liveness: one drain tick happened now (also when nothing was due)."""
    Q.record_tick(conn)
