"""The whole product on a secured estate (CONTRACT section 8), as `pin stack up --secure` makes
it: PostgreSQL TLS + SCRAM only, Kafka SASL_SSL with a SCRAM user, ClickHouse's TLS port with a
writer and a `readonly = 2` reader, one CA. Every command and `pin serve` run as a login role
holding only `pin_worker`; `pin devstats labels` and `pin api serve` as the ClickHouse reader.

Then no secret anywhere: every password the estate holds (its `*.password` files) is searched
for in every output of every command, `pin serve`'s and the read API's logs, and every row of
Dagster's run, event and schedule storage.

The services of each kind alone, their failure lines and rotation are the modules
test_pg_secured, test_kafka_secured and test_clickhouse_secured; this one proves they work
together, with the settings `pin stack up --secure` prints and nothing else. All four share the
session's estate (tests/support/secured.py): this module's `pin stack up --secure` starts what no
module before started, and finds the rest running, made as new first.
"""

from __future__ import annotations

import os
import signal
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
import psycopg
import pytest
from psycopg import sql

from pin_pipelines.config import dagster_pg_dsn, dagster_pg_url_from
from pin_pipelines.defs.devstats.jobs import dim_layout_group_job
from pin_pipelines.defs.relay.jobs import outbox_relay_job
from pin_pipelines.stack.postgres import scram_verifier
from pin_pipelines.stack.process import free_port, wait_until
from pin_pipelines.stack.secure import KAFKA_CLIENT, SecuredEstate
from tests.support.api import running_api
from tests.support.chessboard import make_building, make_layout, make_layout_group, make_object
from tests.support.chessboard import make_project as make_project_row
from tests.support.cli import run_pin, summary
from tests.support.idp import IdentityProvider, api_env
from tests.support.secured import clear_estate
from tests.support.serve import kill_session, start_serve

#: The secured estate (tests/support/secured.py) starts once per worker: its four modules run
#: one after another on one worker, so it starts once per run.
pytestmark = pytest.mark.xdist_group("secured")

WORKER, READER = "pin_w_login", "pin_r_login"


@dataclass
class Secured:
    """The estate, the settings it printed, and every output the module's commands gave."""

    estate: SecuredEstate
    root: Path
    exports: dict[str, str]
    outputs: list[str] = field(default_factory=list)

    def env(self, role: str, *, reader: bool = False, **extra: str) -> dict[str, str]:
        """The printed settings with `role` as PostgreSQL's user (its password in the passfile)
        and, for `reader`, the ClickHouse reader; Dagster's storage derived from them."""
        dsn = self.estate.postgres.client_dsn(role)
        return {
            **self.exports,
            **(self.estate.reader_clickhouse() if reader else {}),
            "PIN_STATE_DIR": str(self.root),
            "PIN_PG_DSN": dsn,
            "PIN_DAGSTER_PG_URL": dagster_pg_url_from(dsn),
            "PIN_RELAY_TRANSACTIONAL_ID": f"pin-outbox-relay-estate-{self.root.name}",
            **extra,
        }

    def pin(self, *args: str, env: dict[str, str]) -> dict[str, object]:
        result = run_pin(*args, env=env)
        self.outputs += [result.stdout, result.stderr]
        parsed: dict[str, object] = summary(result)
        return parsed

    def secrets(self) -> list[str]:
        return [p.read_text().strip() for p in self.estate.password_files()]


@pytest.fixture(scope="module")
def secured(secured_estate: SecuredEstate) -> Secured:
    """`pin stack up --secure` in the state folder of the session's estate (stopped at the
    session's end), whose running services are first made as new; `pin db migrate` as the
    owner with the printed settings; the two login roles made by the owner."""
    estate = secured_estate
    root = estate.folder.parent
    clear_estate(estate)
    up = run_pin("stack", "up", "--secure", env={"PIN_STATE_DIR": str(root)})
    exports: dict[str, str] = summary(up)["settings"]
    assert all(f"export {name}=" in up.stdout for name in exports), up.stdout
    secured = Secured(estate, root, exports, [up.stdout, up.stderr])
    secured.pin("db", "migrate", env={**exports, "PIN_STATE_DIR": str(root)})
    with psycopg.connect(exports["PIN_PG_DSN"], autocommit=True) as conn:
        for role, group in ((WORKER, "pin_worker"), (READER, "pin_reader")):
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                    sql.Identifier(role),
                    scram_verifier(conn, role, estate.postgres.password(role)),
                    sql.Identifier(group),
                )
            )
    return secured


def _catalogue(conn: psycopg.Connection) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
    """A project (tenant, project, its layout group), written as the catalogue writes it."""
    project = make_project_row(conn)
    group = make_layout_group(conn, project, "Студии")
    make_object(conn, project, make_building(conn, project), make_layout(conn, project, group, 40))
    tenant = conn.execute("SELECT tenant_id FROM chessboard.projects WHERE id = %s", (project,))
    row = tenant.fetchone()
    assert row is not None
    return row[0], project, group


def _labels(secured: Secured, tenant: uuid.UUID, group: uuid.UUID) -> object:
    env = secured.env(READER, reader=True)
    return secured.pin(
        "devstats", "labels", "--developer-id", str(tenant), "--ids", str(group), env=env
    )[str(group)]


def test_the_pipeline_runs_as_the_least_privileged_roles(secured: Secured, tmp_path: Path) -> None:
    """Tried, with only the settings `pin stack up --secure` printed: as the worker login, an
    edit, `pin recalc drain --once`, `pin outbox relay --once` (SASL_SSL, transactions),
    `pin devstats load --once` (ClickHouse TLS as the writer); as the readers, `pin devstats
    labels` and `pin api serve` answer the group's name; `pin reconcile` finds no drift."""
    worker = secured.env(WORKER)
    with psycopg.connect(worker["PIN_PG_DSN"], autocommit=True) as conn:
        tenant, _, group = _catalogue(conn)
        conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
    assert secured.pin("recalc", "drain", "--once", env=worker)["processed"] == 1
    assert secured.pin("outbox", "relay", "--once", env=worker)["published"] >= 2
    assert secured.pin("devstats", "load", "--once", env=worker)["inserted"] >= 1
    assert _labels(secured, tenant, group) == "Студии"
    with IdentityProvider() as idp:
        with running_api(secured.env(READER, reader=True, **api_env(idp)), tmp_path) as api:
            answer = api.get(f"/v1/layout-groups/labels?ids={group}", token=idp.token(tenant))
        secured.outputs.append(api.stderr())
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"labels": {str(group): "Студии"}}
    reconciled = secured.pin("reconcile", env=worker)
    assert (reconciled["projects_drifted"], reconciled["dim_rows_drifted"]) == (0, 0)


def test_pin_serve_carries_an_edit_to_the_dimension_as_the_worker(
    secured: Secured, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tried: `pin serve` as the worker login on the secured estate (Dagster's storage in its
    `dagster` database, granted by the owner's migrate); a group renamed and its project due.
    The sensors' drain, relay and load runs carry the new name to the dimension, where the
    reader sees it. Then Kafka's SCRAM password is rotated on the broker and in the file
    PIN_KAFKA_CONFIG names, `pin serve` left running: a relay run and a load run launched after
    the rotation (new clients, the new password) succeed, and a second rename made after it
    reaches the dimension. A SIGTERM stops `pin serve` with status 0; no run ended FAILURE."""
    home = tmp_path / "dagster_home"
    env = {**os.environ, **secured.env(WORKER, DAGSTER_HOME=str(home))}
    env["PIN_DAGSTER_PORT"] = str(free_port())
    env["PIN_LONG_RUN_SECONDS"] = "60"  # long-lived runs hand over soon after the rotation
    monkeypatch.setenv("PIN_DAGSTER_PG_URL", env["PIN_DAGSTER_PG_URL"])  # the instance's storage
    with psycopg.connect(env["PIN_PG_DSN"], autocommit=True) as conn:
        tenant, _, group = _catalogue(conn)
        conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
    log = tmp_path / "serve.log"
    serve = start_serve(env, log)
    try:

        def named(name: str) -> bool:
            assert serve.poll() is None, log.read_text()[-3000:]
            return _labels(secured, tenant, group) == name

        wait_until(lambda: named("Студии"), timeout=150, what="the new group in the dimension")
        with psycopg.connect(env["PIN_PG_DSN"], autocommit=True) as conn:
            conn.execute(
                "UPDATE chessboard.layout_groups SET name = 'Люкс' WHERE id = %s", (group,)
            )
            conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
        wait_until(lambda: named("Люкс"), timeout=120, what="the renamed group in the dimension")
        kafka = secured.estate.kafka
        kafka.rotate_scram_password()
        kafka.client_properties(KAFKA_CLIENT)  # the file PIN_KAFKA_CONFIG names, rewritten
        rotated = datetime.now(UTC).timestamp()
        with psycopg.connect(env["PIN_PG_DSN"], autocommit=True) as conn:
            conn.execute(
                "UPDATE chessboard.layout_groups SET name = 'Пентхаусы' WHERE id = %s", (group,)
            )
            conn.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
        with dg.DagsterInstance.from_config(str(home)) as instance:

            def ran_after_rotation(job: str) -> bool:
                runs = instance.get_run_records(
                    dg.RunsFilter(job_name=job, statuses=[dg.DagsterRunStatus.SUCCESS])
                )
                return any((r.start_time or 0) > rotated for r in runs)

            wait_until(
                lambda: (
                    named("Пентхаусы")
                    and ran_after_rotation(outbox_relay_job.name)
                    and ran_after_rotation(dim_layout_group_job.name)
                ),
                timeout=180,
                what="relay and load runs with the rotated password",
            )
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=90)
        assert serve.returncode == 0, log.read_text()[-3000:]
    finally:
        kill_session(serve.pid)
        serve.wait(timeout=30)
        secured.outputs.append(log.read_text())
    with dg.DagsterInstance.from_config(str(home)) as instance:
        failed = instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE]))
    assert failed == [], [r.job_name for r in failed]


def test_no_secret_is_printed_or_stored(secured: Secured) -> None:
    """Tried: every password of the estate (PostgreSQL's owner and logins, Kafka's SCRAM and
    PLAIN users and keystore, ClickHouse's writer and reader), searched for in every output the
    module's commands gave (stdout and stderr, `pin serve`'s and the read API's logs) and in
    every row of every table of Dagster's storage (runs, their config and tags, the event log,
    ticks). Runs after the module's other tests, which left their runs there."""
    secrets = secured.secrets()
    assert len(secrets) >= 6, secured.estate.password_files()
    for text in secured.outputs:
        for secret in secrets:
            assert secret not in text
    storage = dagster_pg_dsn(dagster_pg_url_from(secured.exports["PIN_PG_DSN"]))
    with psycopg.connect(storage, autocommit=True) as conn:
        tables = [
            row[0]
            for row in conn.execute(
                "SELECT quote_ident(table_name) FROM information_schema.tables"
                " WHERE table_schema = 'public' AND table_type = 'BASE TABLE'"
            )
        ]
        assert "runs" in tables and "event_logs" in tables, tables
        for table in tables:
            rows = conn.execute(f"SELECT t::text FROM {table} t").fetchall()
            dumped = "\n".join(row[0] for row in rows)
            for secret in secrets:
                assert secret not in dumped, f"a password is stored in Dagster's {table}"
