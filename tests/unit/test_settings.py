"""Settings from the environment (config.py, contract section 1): defaults, every variable read,
and the one-line PinError of a bad value. Only mappings are parsed: nothing is reached."""

from __future__ import annotations

from pathlib import Path

import pytest

from pin_pipelines.config import (
    DEFAULT_CLICKHOUSE_SERVER_URL,
    PgTarget,
    Settings,
    dagster_pg_url_from,
    dsn_with_dbname,
    traceback_requested,
)
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import TopicPolicy

STATE = {"PIN_STATE_DIR": "/srv/pin-state"}


def test_defaults_follow_the_state_folder_and_the_database() -> None:
    """Tried: only PIN_STATE_DIR set. Every other setting takes the README table's default."""
    settings = Settings.from_env(STATE)
    assert settings.pg_dsn == "postgresql://postgres@127.0.0.1:5432/pin"
    assert settings.kafka_bootstrap == "127.0.0.1:9092"
    assert settings.clickhouse_url == "chdb:///srv/pin-state/chdb"
    assert settings.clickhouse_cluster is None
    assert settings.clickhouse_server_url == DEFAULT_CLICKHOUSE_SERVER_URL
    assert settings.dagster_home == Path("/srv/pin-state/dagster_home")
    assert settings.dagster_port == 3000
    assert settings.dagster_pg_url == "postgresql+psycopg2://postgres@127.0.0.1:5432/dagster"
    assert settings.relay_transactional_id == "pin-outbox-relay-pin"
    assert (settings.metrics_addr, settings.metrics_port) == ("127.0.0.1", 9108)
    assert settings.recalc_max_drain_runs == 2
    assert settings.recalc_tick_seconds == 5
    assert settings.devstats_max_load_runs == 1
    assert settings.dagster_retention_success_days == 3.0
    assert settings.dagster_retention_failure_days == 14.0
    assert settings.kafka_partitions == 6
    assert settings.kafka_replication_factor is None
    assert settings.kafka_min_insync_replicas is None
    assert settings.long_run_seconds == 600
    assert settings.code_server_port is None
    assert settings.relay_backstop_seconds == 5.0


def test_every_variable_is_read() -> None:
    env = {
        **STATE,
        "PIN_PG_DSN": "postgresql://app@db.internal:6432/catalogue",
        "PIN_KAFKA_BOOTSTRAP": "k1:9092,k2:9092",
        "PIN_CLICKHOUSE_URL": "clickhouse://u:p@ch:9000/pin_dev_stats",
        "PIN_CLICKHOUSE_CLUSTER": "pin_cluster",
        "PIN_CLICKHOUSE_SERVER_URL": "clickhouse://default@127.0.0.1:9010/pin_dev_stats",
        "DAGSTER_HOME": "/srv/dagster",
        "PIN_DAGSTER_PORT": "3100",
        "PIN_DAGSTER_PG_URL": "postgresql+psycopg2://d@db/dagster_x",
        "PIN_RECALC_MAX_DRAIN_RUNS": "4",
        "PIN_RECALC_TICK_SECONDS": "10",
        "PIN_RELAY_TRANSACTIONAL_ID": "relay-a",
        "PIN_DAGSTER_RETENTION_SUCCESS_DAYS": "0.5",
        "PIN_DAGSTER_RETENTION_FAILURE_DAYS": "30",
        "PIN_METRICS_ADDR": "0.0.0.0",
        "PIN_METRICS_PORT": "9200",
        "PIN_KAFKA_PARTITIONS": "12",
        "PIN_KAFKA_REPLICATION_FACTOR": "3",
        "PIN_KAFKA_MIN_INSYNC_REPLICAS": "2",
        "PIN_DEVSTATS_MAX_LOAD_RUNS": "3",
        "PIN_LONG_RUN_SECONDS": "600",
        "PIN_CODE_SERVER_PORT": "3130",
        "PIN_RELAY_BACKSTOP_SECONDS": "2.5",
    }
    s = Settings.from_env(env)
    assert (s.pg_dsn, s.kafka_bootstrap) == (env["PIN_PG_DSN"], "k1:9092,k2:9092")
    assert (s.clickhouse_url, s.clickhouse_cluster) == (env["PIN_CLICKHOUSE_URL"], "pin_cluster")
    assert s.clickhouse_server_url == env["PIN_CLICKHOUSE_SERVER_URL"]
    assert (s.dagster_home, s.dagster_port) == (Path("/srv/dagster"), 3100)
    assert s.dagster_pg_url == env["PIN_DAGSTER_PG_URL"]
    assert (s.recalc_max_drain_runs, s.relay_transactional_id) == (4, "relay-a")
    assert s.recalc_tick_seconds == 10
    assert (s.dagster_retention_success_days, s.dagster_retention_failure_days) == (0.5, 30.0)
    assert (s.metrics_addr, s.metrics_port) == ("0.0.0.0", 9200)
    assert (s.kafka_partitions, s.kafka_replication_factor, s.kafka_min_insync_replicas) == (
        12,
        3,
        2,
    )
    assert s.devstats_max_load_runs == 3
    assert s.long_run_seconds == 600
    assert s.code_server_port == 3130
    assert s.relay_backstop_seconds == 2.5
    assert s.pg == PgTarget("db.internal", 6432, "app", "catalogue")
    assert s.kafka_host_port == ("k1", 9092) and not s.kafka_is_local


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PIN_DAGSTER_PORT": "web"}, r"^PIN_DAGSTER_PORT must be a port number, got 'web'$"),
        ({"PIN_METRICS_PORT": "70000"}, r"^PIN_METRICS_PORT must be a port number"),
        ({"PIN_RECALC_MAX_DRAIN_RUNS": "0"}, r"^PIN_RECALC_MAX_DRAIN_RUNS must be a whole number"),
        ({"PIN_RECALC_TICK_SECONDS": "0"}, r"^PIN_RECALC_TICK_SECONDS must be a whole number ≥ 1"),
        ({"PIN_KAFKA_PARTITIONS": "2.5"}, r"^PIN_KAFKA_PARTITIONS must be a whole number ≥ 1"),
        ({"PIN_DAGSTER_RETENTION_SUCCESS_DAYS": "0"}, r"must be a number of days > 0, got '0'$"),
        ({"PIN_DAGSTER_RETENTION_FAILURE_DAYS": "two"}, r"must be a number of days > 0"),
        ({"PIN_CLICKHOUSE_CLUSTER": "pin-cluster"}, r"^PIN_CLICKHOUSE_CLUSTER must be a cluster"),
        ({"PIN_PG_DSN": "mysql://db/pin"}, r"^PIN_PG_DSN must be a postgresql:// URL"),
        ({"PIN_PG_DSN": "postgresql://db:port/pin"}, r"^PIN_PG_DSN has a bad port"),
        # The embedded engine admits one process per folder: one loader there.
        ({"PIN_DEVSTATS_MAX_LOAD_RUNS": "2"}, r"needs a ClickHouse server"),
        # A run shorter than its successor's longest launch margin would hand over at once.
        ({"PIN_LONG_RUN_SECONDS": "45"}, r"^PIN_LONG_RUN_SECONDS must be at least 60 .*got 45$"),
        ({"PIN_LONG_RUN_SECONDS": "5m"}, r"^PIN_LONG_RUN_SECONDS must be a whole number ≥ 1"),
        ({"PIN_CODE_SERVER_PORT": "grpc"}, r"^PIN_CODE_SERVER_PORT must be a port number"),
        ({"PIN_CODE_SERVER_PORT": "3000"}, r"^PIN_CODE_SERVER_PORT must differ from PIN_DAGSTER"),
        # Above 60 the relay's session would idle into its 2-minute timeout between looks.
        ({"PIN_RELAY_BACKSTOP_SECONDS": "61"}, r"^PIN_RELAY_BACKSTOP_SECONDS must be a number"),
        ({"PIN_RELAY_BACKSTOP_SECONDS": "0"}, r"above 0 and at most 60, got '0'$"),
        ({"PIN_RELAY_BACKSTOP_SECONDS": "5s"}, r"above 0 and at most 60, got '5s'$"),
    ],
)
def test_a_bad_value_is_refused_in_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(PinError, match=message) as raised:
        Settings.from_env({**STATE, **env})
    assert "\n" not in str(raised.value)


def test_a_bad_kafka_bootstrap_is_refused_when_used() -> None:
    with pytest.raises(PinError, match=r"^PIN_KAFKA_BOOTSTRAP must be host:port"):
        _ = Settings.from_env({**STATE, "PIN_KAFKA_BOOTSTRAP": "broker"}).kafka_host_port


def test_postgres_urls() -> None:
    assert PgTarget.parse("postgres://") == PgTarget("127.0.0.1", 5432, "postgres", "pin")
    assert PgTarget.parse("postgresql://postgres@localhost:5433/x").is_local
    assert not PgTarget.parse("postgresql://postgres@db.internal/x").is_local
    assert dsn_with_dbname("postgresql://u:p@h:1/a?sslmode=require", "b") == (
        "postgresql://u:p@h:1/b?sslmode=require"
    )
    assert dagster_pg_url_from("postgresql://u@h:5/app") == "postgresql+psycopg2://u@h:5/dagster"


def test_topic_policy_resolves_against_the_cluster() -> None:
    """Unset: replication min(3, brokers), min.insync.replicas one less and at least 1."""
    unset = TopicPolicy.from_settings(Settings.from_env(STATE))
    assert [
        (s.replication_factor, s.min_insync_replicas) for s in map(unset.resolve, (1, 2, 5))
    ] == [
        (1, 1),
        (2, 1),
        (3, 2),
    ]
    env = {**STATE, "PIN_KAFKA_REPLICATION_FACTOR": "2", "PIN_KAFKA_MIN_INSYNC_REPLICAS": "2"}
    spec = TopicPolicy.from_settings(Settings.from_env(env)).resolve(5)
    assert (spec.partitions, spec.replication_factor, spec.min_insync_replicas) == (6, 2, 2)


def test_pin_debug_asks_for_the_traceback() -> None:
    assert traceback_requested({"PIN_DEBUG": "1"})
    assert not traceback_requested({"PIN_DEBUG": ""})
    assert not traceback_requested({})


def test_the_recalc_sensor_ticks_at_the_setting() -> None:
    """The sensor's interval is PIN_RECALC_TICK_SECONDS, read when the definitions load (here:
    unset, so the spec's 5 s); the alert rules count missed ticks in the same unit."""
    from pin_pipelines.defs.recalc.sensors import recalc_queue_sensor

    assert (
        recalc_queue_sensor.minimum_interval_seconds == Settings.from_env(STATE).recalc_tick_seconds
    )
