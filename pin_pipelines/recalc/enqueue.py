"""The operators' side of the enqueue: the runbook's force-recalc and poison requeue.

The raisers need none of this: triggers on property_objects, layouts and buildings call
`chessboard.request_project_recalc` in the writer's own transaction (sql/postgres/schema/queue.sql).
"""

from __future__ import annotations

from enum import StrEnum
from uuid import UUID

import psycopg

from pin_pipelines.db import connection, queries
from pin_pipelines.errors import PinError
from pin_pipelines.sql_faces import RecalcQueries

Q = queries("recalc", RecalcQueries)


class RecalcReason(StrEnum):
    """RecalcTriggerReason of the spec, plus the two operator paths (varchar(32))."""

    PROPERTY_OBJECT_STATUS_CHANGED = "PropertyObjectStatusChanged"
    PROPERTY_OBJECT_PRICE_CHANGED = "PropertyObjectPriceChanged"
    PROPERTY_OBJECT_UPSERTED = "PropertyObjectUpserted"
    LAYOUT_CHANGED = "LayoutChanged"
    TALENT_SYNC = "TalentSync"
    CRUD = "Crud"
    MANUAL = "Manual"
    RECONCILE = "Reconcile"


def force_request(conn: psycopg.Connection, project_id: UUID, reason: RecalcReason) -> None:
    """The queue row of an existing project becomes due now, in the caller's transaction (a
    project that does not exist gets none)."""
    Q.force_request(conn, project_id=project_id, reason=str(reason))


def force_recalc(dsn: str, project_id: UUID, reason: RecalcReason = RecalcReason.MANUAL) -> None:
    """Runbook "ручной форс-пересчёт": upsert the queue row with due_at = now()."""
    with connection(dsn) as conn, conn.transaction():
        if Q.project_exists(conn, project_id=project_id) is None:
            raise PinError(f"project {project_id} does not exist")
        force_request(conn, project_id, reason)


def requeue_poisoned(dsn: str, project_id: UUID) -> None:
    """Runbook for a poison row: attempt_count = 0, last_error = null, due_at = now()."""
    with connection(dsn) as conn, conn.transaction():
        if not Q.requeue_request(conn, project_id=project_id):
            raise PinError(f"project {project_id} has no row in the recalc queue")
