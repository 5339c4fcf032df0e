"""`pin db migrate`: the PostgreSQL schema (yoyo-migrations over plain .sql files), the ClickHouse
database and the Kafka topics. Each step is idempotent."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from yoyo import get_backend, read_migrations

from pin_pipelines.config import SQL_DIR, Settings
from pin_pipelines.db import connect
from pin_pipelines.errors import PinError

PG_MIGRATIONS = SQL_DIR / "postgres" / "migrations"


def migrate_postgres(dsn: str) -> list[str]:
    """Apply pending migrations under yoyo's lock (two concurrent `migrate`s do not race)."""
    connect(dsn).close()  # a clear error when the server is not there, before yoyo's own
    parts = urlsplit(dsn)
    backend = get_backend(urlunsplit(parts._replace(scheme="postgresql+psycopg")))
    migrations = read_migrations(str(PG_MIGRATIONS))
    with backend.lock():
        pending = backend.to_apply(migrations)
        backend.apply_migrations(pending)
    return [m.id for m in pending]


def migrate_all(settings: Settings, *, allow_weaker_topics: bool = False) -> dict[str, object]:
    """Every step; Kafka topics are created after the settings' TopicPolicy, and existing ones
    weaker than it (fewer partitions, lower replication factor or min.insync.replicas) fail the
    migration unless `allow_weaker_topics`: a production cluster must not run on topics that lose
    events with one broker. Existing snapshot topics are made compacted changelogs in place. A
    topic is never shrunk nor recreated."""
    from pin_pipelines.clickhouse import migrate_clickhouse, open_clickhouse
    from pin_pipelines.kafka import TopicPolicy, check_topics, compact_changelogs, ensure_topics

    applied = migrate_postgres(settings.pg_dsn)
    with open_clickhouse(settings.clickhouse_url) as ch:
        clickhouse_applied = migrate_clickhouse(ch, settings.clickhouse_cluster)
    policy = TopicPolicy.from_settings(settings)
    try:
        topics = ensure_topics(settings.kafka_bootstrap, policy=policy)
        compacted = compact_changelogs(
            settings.kafka_bootstrap, min_compaction_lag_ms=policy.min_compaction_lag_ms
        )
        weaker = check_topics(settings.kafka_bootstrap, policy=policy)
    except PinError as exc:
        raise PinError(f"schema migrated, but Kafka topics were not created: {exc}") from exc
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
        "kafka_topics_compacted": compacted,
        "kafka_topics_weaker": weaker,
    }
