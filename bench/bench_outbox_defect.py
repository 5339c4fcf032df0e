"""What the outbox's `defect` column costs a writer: migration 0005's check against the current one
(0017), in the same run. Not a test; prints ONE JSON line.

A fresh migrated database `pin_bench_outbox_defect` gets two tables shaped as outbox_events'
written columns (topic, key, payload, and the stored generated `wire_value` and `defect`): one
computing `defect` with the product's chessboard.outbox_event_defect, one with a copy of 0005's
(read from the migration file, in a schema of its own). Each round, the two alternating, writes
to each table: STATEMENTS single-row INSERTs from a plpgsql loop (a drain's project publishing:
each INSERT a new executor, which prepares the generated columns), then one INSERT of BULK rows
(`pin reconcile`'s republish). Reported: the backend's CPU (its CPU clock) per statement and per
row, and current / 0005.

    .venv/bin/python bench/bench_outbox_defect.py [--statements 5000] [--bulk 50000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fresh_database, load_average
from _cpu import process_cpu_seconds

MIGRATION_0005 = (
    Path(__file__).resolve().parents[1] / "sql/postgres/migrations/0005_outbox_wire_text.sql"
)
#: The check of each table's `defect` column.
CHECKS = {"current": "chessboard.outbox_event_defect", "0005": "bench_0005.outbox_event_defect"}
KEY = "0a1b2c3d-0000-4000-8000-000000000001"
PAYLOAD = (
    '{"ContractVersion": 1, "EventId": "e", "CreatedAt": "2025-01-31T10:20:30.123Z",'
    f' "Id": "{KEY}", "Version": 3, "Name": "x"}}'
)


def create_tables(conn: psycopg.Connection) -> None:
    text = MIGRATION_0005.read_text()
    body = re.search(r"CREATE FUNCTION chessboard\.outbox_event_defect.*?\$\$;", text, re.S)
    assert body, "0005's outbox_event_defect not found"
    conn.execute("CREATE SCHEMA bench_0005")
    conn.execute(body.group(0).replace("chessboard.", "bench_0005."))
    for name, check in CHECKS.items():
        conn.execute(
            f'CREATE TABLE "written_{name}" (id bigserial PRIMARY KEY, topic text NOT NULL,'
            " message_key text NOT NULL, payload jsonb NOT NULL,"
            " wire_value text GENERATED ALWAYS AS (payload::text) STORED,"
            f" defect text GENERATED ALWAYS AS ({check}(message_key, payload)) STORED)"
        )


def backend_cpu(conn: psycopg.Connection, sql: str) -> float:
    """The CPU-seconds `conn`'s backend spends on `sql`."""
    before = process_cpu_seconds(conn.info.backend_pid)
    conn.execute(sql)
    after = process_cpu_seconds(conn.info.backend_pid)
    assert before is not None and after is not None, "the server is not on this machine"
    return after - before


def measure(conn: psycopg.Connection, name: str, statements: int, bulk: int) -> dict[str, float]:
    table = f'"written_{name}"'
    values = f"('t', '{KEY}', '{PAYLOAD}'::jsonb)"
    single = backend_cpu(
        conn,
        f"DO $$ BEGIN FOR i IN 1..{statements} LOOP"
        f" INSERT INTO {table} (topic, message_key, payload) VALUES {values};"
        " END LOOP; END $$",
    )
    many = backend_cpu(
        conn,
        f"INSERT INTO {table} (topic, message_key, payload)"
        f" SELECT 't', '{KEY}', '{PAYLOAD}'::jsonb FROM generate_series(1, {bulk})",
    )
    conn.execute(f"TRUNCATE {table}")
    return {"us_per_statement": single / statements * 1e6, "us_per_row_bulk": many / bulk * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--statements", type=int, default=5000)
    parser.add_argument("--bulk", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result: dict[str, Any] = {"load_average_before": load_average()}
    dsn = fresh_database("pin_bench_outbox_defect")
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in CHECKS}
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_tables(conn)
        for number in range(args.rounds):
            for name in CHECKS if number % 2 == 0 else reversed(CHECKS):
                rounds[name].append(measure(conn, name, args.statements, args.bulk))
    for name, found in rounds.items():
        result[name] = {
            key: round(statistics.median(r[key] for r in found), 2) for key in found[0]
        } | {"rounds": [{k: round(v, 2) for k, v in r.items()} for r in found]}
    result["ratio_current_to_0005"] = {
        key: round(result["current"][key] / result["0005"][key], 3)
        for key in ("us_per_statement", "us_per_row_bulk")
    }
    result["load_average_after"] = load_average()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
