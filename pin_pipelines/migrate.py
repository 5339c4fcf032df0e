"""`pin db migrate`: the PostgreSQL schema (yoyo-migrations over plain .sql files), the ClickHouse
database and the Kafka topics. Each step is idempotent."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from yoyo import get_backend, read_migrations
from yoyo.backends.base import DatabaseBackend
from yoyo.migrations import MigrationList

from pin_pipelines.config import SQL_DIR, Settings, dagster_pg_dsn, with_driver
from pin_pipelines.db import connect
from pin_pipelines.errors import PinError, first_line
from pin_pipelines.logs import log_event
from pin_pipelines.redact import redact_url

log = logging.getLogger("pin_pipelines.migrate")

PG_MIGRATIONS = SQL_DIR / "postgres" / "migrations"
PG_SCHEMA = SQL_DIR / "postgres" / "schema"
#: The current definitions, in the order they are applied: each file's objects reference only
#: its own and those of the files before it (sql/postgres/schema/README.md).
PG_SCHEMA_FILES = ("catalogue.sql", "queue.sql", "outbox.sql", "metrics.sql", "recalc.sql")
#: The group roles' privileges (migration 0019's roles), applied after every migrate.
PG_GRANTS = SQL_DIR / "postgres" / "grants.sql"
#: pin_worker's privileges on Dagster's storage, applied after its tables are made.
DAGSTER_GRANTS = SQL_DIR / "postgres" / "dagster_grants.sql"


#: How long a migration's statement waits for a lock before it gives up (CONTRACT section 9: no
#: writer waits a second on a migrate). A DDL statement waiting for a table's lock holds up
#: every writer queued behind it for as long as it waits: behind a long transaction, for ever.
MIGRATION_LOCK_TIMEOUT_MS = 500
#: A migration that gave up waiting is tried again this many times, this far apart (writers
#: go on meanwhile); then `pin db migrate` fails in one line, nothing of it applied.
MIGRATION_ATTEMPTS = 30
MIGRATION_RETRY_SECONDS = 1.0


def migrate_postgres(dsn: str, migrations_dir: Path = PG_MIGRATIONS) -> list[str]:
    """Apply pending migrations, then grants.sql, under yoyo's lock (two concurrent `migrate`s do
    not race). A role that may not change the schema (a worker's) is told, in one line, to run
    it as the schema's owner. Every migration runs with a short lock_timeout and is retried
    when it gives up waiting (`_apply_waiting_for_locks`)."""
    with connect(dsn) as conn:  # a clear error when the server is not there, before yoyo's own
        user = conn.info.user
    backend = get_backend(_with_lock_timeout(with_driver(dsn, "postgresql+psycopg")))
    migrations = read_migrations(str(migrations_dir))
    try:
        with backend.lock():
            pending = [m.id for m in backend.to_apply(migrations)]
            _apply_waiting_for_locks(backend, migrations, dsn)
            with connect(dsn) as conn:
                conn.execute(PG_GRANTS.read_text())
    except (psycopg.errors.InsufficientPrivilege, psycopg.errors.RaiseException) as exc:
        raise PinError(
            f"PostgreSQL at {redact_url(dsn)}: {user} may not migrate the schema "
            f"({first_line(exc)}); run `pin db migrate` as the schema's owner (with CREATEROLE "
            'for the group roles, docs/production.md "PostgreSQL")'
        ) from exc
    finally:
        # yoyo's backend keeps its connection until the garbage collector finds it: a caller
        # that goes on (the tests' template database, copied right after) would find the
        # database still in use.
        backend.connection.close()
    return pending


def _with_lock_timeout(url: str) -> str:
    """`url` with lock_timeout in its libpq `options`: yoyo opens a connection per migration
    from the URL, so a session's SET would not reach them."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query["options"] = " ".join(
        filter(None, (query.get("options"), f"-c lock_timeout={MIGRATION_LOCK_TIMEOUT_MS}"))
    )
    return urlunsplit(parts._replace(query=urlencode(query, safe=",")))


def _apply_waiting_for_locks(backend: DatabaseBackend, migrations: MigrationList, dsn: str) -> None:
    """The pending migrations, each in its transaction. One that gave up waiting for a lock
    (a running transaction holds the table) is rolled back and tried again after
    MIGRATION_RETRY_SECONDS, so writers wait at most MIGRATION_LOCK_TIMEOUT_MS behind it,
    never for the holder's whole transaction."""
    for attempt in range(1, MIGRATION_ATTEMPTS + 1):
        try:
            backend.apply_migrations(backend.to_apply(migrations))
            return
        except psycopg.errors.LockNotAvailable as exc:
            if attempt == MIGRATION_ATTEMPTS:
                raise PinError(
                    f"PostgreSQL at {redact_url(dsn)}: a migration waited for a lock "
                    f"{MIGRATION_ATTEMPTS} times ({first_line(exc)}); a long transaction holds a "
                    "table it changes: find it in pg_stat_activity, end it, run `pin db migrate` "
                    "again"
                ) from exc
            time.sleep(MIGRATION_RETRY_SECONDS)


def apply_schema_files(dsn: str) -> None:
    """Build the schema from its current definitions (sql/postgres/schema/) on an empty database,
    in one transaction, granted as `migrate_postgres` grants it. Not a way to deploy (a database
    is only ever migrated, and yoyo's history would be missing):
    tests/integration/test_schema_current.py compares the result with a migrated database, so
    the files read as what runs now cannot drift from the migrations."""
    with connect(dsn) as conn, conn.transaction():
        for name in PG_SCHEMA_FILES:
            conn.execute((PG_SCHEMA / name).read_bytes())
        conn.execute(PG_GRANTS.read_bytes())


def migrate_dagster_storage(storage_url: str) -> None:
    """Dagster's tables, made by the owner running `pin db migrate` (dagster-postgres makes them
    at first use, which a pin_worker login may not: it has no CREATE), then granted to
    pin_worker. Made here by dagster-postgres itself, so they are exactly what Dagster would
    make; tables that exist are left as they are. A role that may not make or grant them
    is told, in one line, to run it as the owner of Dagster's database."""
    from dagster_postgres import DagsterPostgresStorage
    from sqlalchemy.exc import DBAPIError

    dsn = dagster_pg_dsn(storage_url)
    connect(dsn).close()  # a missing database or server in one line, before SQLAlchemy's
    try:
        DagsterPostgresStorage(storage_url).event_log_storage.dispose()
        with connect(dsn) as conn:
            conn.execute(DAGSTER_GRANTS.read_text())
    except (DBAPIError, psycopg.Error) as exc:
        raise PinError(
            f"PostgreSQL at {redact_url(dsn)}: Dagster's storage was not made and granted "
            f"({redact_url(first_line(exc))}); run `pin db migrate` as the owner of that database"
        ) from exc


def migrate_all(settings: Settings, *, allow_weaker_topics: bool = False) -> dict[str, object]:
    """Every step; Kafka topics are created after the settings' TopicPolicy, and existing ones
    weaker than it (fewer partitions, lower replication factor or min.insync.replicas) fail the
    migration unless `allow_weaker_topics`: a production cluster must not run on topics that lose
    events with one broker. Existing snapshot topics are made compacted changelogs in place; a
    topic setting the operator chose that the broker would refuse the lag setting beside is
    kept, and reported (`kafka_topics_conflicts`, a warning line each). A topic is never shrunk
    nor recreated. A failed Kafka step says which one failed: what came before it is applied."""
    from pin_pipelines.clickhouse import migrate_clickhouse, open_clickhouse
    from pin_pipelines.kafka import TopicPolicy, check_topics, compact_changelogs, ensure_topics

    applied = migrate_postgres(settings.pg_dsn)
    migrate_dagster_storage(settings.dagster_pg_url)
    with open_clickhouse(
        settings.clickhouse_url, password_file=settings.clickhouse_password_file
    ) as ch:
        clickhouse_applied = migrate_clickhouse(ch, settings.clickhouse_cluster)
    policy = TopicPolicy.from_settings(settings)
    bootstrap = settings.kafka_bootstrap
    topics = _kafka_step(
        "Kafka topics were not created", lambda: ensure_topics(bootstrap, policy=policy)
    )
    changelogs = _kafka_step(
        "the snapshot topics were not made compacted changelogs",
        lambda: compact_changelogs(bootstrap, min_compaction_lag_ms=policy.min_compaction_lag_ms),
    )
    for conflict in changelogs.conflicts:
        log_event(log, "kafka_topic_config_conflict", level=logging.WARNING, conflict=conflict)
    weaker = _kafka_step(
        "the Kafka topics could not be checked", lambda: check_topics(bootstrap, policy=policy)
    )
    if weaker and not allow_weaker_topics:
        raise PinError(
            f"schema migrated, but Kafka topics are weaker than configured: {'; '.join(weaker)} "
            "(pin never shrinks or recreates a topic: raise them as docs/runbook.md says, or "
            "accept them with --allow-weaker-topics)"
        )
    return {
        "postgres_applied": applied,
        "clickhouse_applied": clickhouse_applied,
        "kafka_topics_created": topics,
        # Existing snapshot topics brought to the changelog policy in place (CONTRACT §9).
        "kafka_topics_compacted": changelogs.changed,
        "kafka_topics_conflicts": changelogs.conflicts,
        "kafka_topics_weaker": weaker,
    }


T = TypeVar("T")


def _kafka_step(failed: str, step: Callable[[], T]) -> T:
    """A Kafka step of `migrate_all`, its failure saying that the schema was migrated and what
    was not done (before, every Kafka failure said the topics "were not created", also when
    they existed and only a config change was refused)."""
    try:
        return step()
    except PinError as exc:
        raise PinError(f"schema migrated, but {failed}: {exc}") from exc
