"""Read-only views of the queue for operators: poison rows, depth and backlog."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from pin_pipelines.db import connection, fetch_all, queries
from pin_pipelines.sql_faces import RecalcQueries

Q = queries("recalc", RecalcQueries)


@dataclass(frozen=True)
class PoisonedRequest:
    project_id: UUID
    tenant_id: UUID
    attempt_count: int
    last_error: str | None
    last_reason: str
    first_requested_at: datetime
    updated_at: datetime


def poisoned_requests(dsn: str) -> list[PoisonedRequest]:
    with connection(dsn) as conn:
        return fetch_all(Q.poisoned_requests, conn, PoisonedRequest)
