"""`pin sample load`: demo projects inserted the way the chessboard API would write them."""

from __future__ import annotations

from pin_pipelines.db import connection, fetch_column, queries
from pin_pipelines.errors import PinError
from pin_pipelines.sql_faces import SampleQueries

Q = queries("sample", SampleQueries)


def load_sample(dsn: str, *, projects: int = 20) -> dict[str, object]:
    if not 1 <= projects <= 10_000:
        raise PinError("--projects must be between 1 and 10000")
    with connection(dsn) as conn, conn.transaction():
        ids = fetch_column(Q.insert_sample_projects, conn, projects=projects)
    return {"projects_inserted": len(ids), "queued_by_triggers": len(ids)}
