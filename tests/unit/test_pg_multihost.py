"""A PIN_PG_DSN naming several hosts (CONTRACT section 9: a primary and its standbys, libpq picks
the one that takes writes with `target_session_attrs=read-write`) keeps every host and parameter
through each derivation: the settings, the stack's target, another database on the same
servers, the dead-peer bounds, yoyo's URL and Dagster's storage URL (SQLAlchemy + psycopg2).
Each derived URL is read back by the parser that consumes it (libpq, SQLAlchemy, yoyo)."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import make_url
from yoyo.connections import parse_uri

from pin_pipelines.config import (
    PgTarget,
    Settings,
    dagster_pg_url_from,
    dsn_with_dbname,
    pg_hosts,
    with_dead_peer_bounds,
    with_driver,
)
from pin_pipelines.errors import PinError

DSN = "postgresql://pin:s3cret@a:5432,b:5433/pin?target_session_attrs=read-write"


def test_the_target_lists_every_host_and_is_no_cluster_the_stack_owns() -> None:
    target = PgTarget.parse(DSN)
    assert (target.host, target.port, target.user, target.dbname) == ("a", 5432, "pin", "pin")
    assert target.more_hosts == (("b", 5433),)
    assert target.address == "a:5432,b:5433"
    local_pair = PgTarget.parse("postgresql://postgres@127.0.0.1:5432,127.0.0.1:5433/pin")
    assert not local_pair.is_local


def test_hosts_without_ports_and_ipv6() -> None:
    assert pg_hosts("postgresql://u@a,[::1]:6000,c:7/x") == [("a", 5432), ("::1", 6000), ("c", 7)]
    assert pg_hosts("postgresql:///x?host=/run/pg") == []
    with pytest.raises(PinError, match=r"^PIN_PG_DSN has a bad port"):
        Settings.from_env({"PIN_PG_DSN": "postgresql://u@a:5432,b:port/x"})


def test_settings_accept_it() -> None:
    settings = Settings.from_env({"PIN_PG_DSN": DSN, "PIN_STATE_DIR": "/tmp/pin-multihost"})
    assert settings.relay_transactional_id == "pin-outbox-relay-pin"
    assert settings.pg.address == "a:5432,b:5433"


def test_another_database_and_the_dead_peer_bounds_keep_hosts_and_parameters() -> None:
    other = dsn_with_dbname(DSN, "postgres")
    assert other == "postgresql://pin:s3cret@a:5432,b:5433/postgres?target_session_attrs=read-write"
    bounded = conninfo_to_dict(with_dead_peer_bounds(DSN))
    assert (bounded["host"], bounded["port"], bounded["dbname"]) == ("a,b", "5432,5433", "pin")
    assert bounded["target_session_attrs"] == "read-write"
    assert bounded["tcp_user_timeout"] == "15000"


def test_dagster_storage_url_reaches_psycopg2_with_every_host() -> None:
    """What SQLAlchemy's psycopg2 dialect hands to psycopg2.connect (and so to libpq)."""
    from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2

    url = with_dead_peer_bounds(dagster_pg_url_from(DSN))
    _, kwargs = PGDialect_psycopg2().create_connect_args(make_url(url))
    assert kwargs["host"] == "a,b" and kwargs["port"] == "5432,5433"
    assert kwargs["dbname" if "dbname" in kwargs else "database"] == "dagster"
    assert (kwargs["user"], kwargs["password"]) == ("pin", "s3cret")
    assert kwargs["target_session_attrs"] == "read-write"
    assert kwargs["keepalives"] == "1"
    # `pin serve` checks the storage with libpq under the plain scheme.
    libpq = conninfo_to_dict(url.replace("postgresql+psycopg2:", "postgresql:", 1))
    assert (libpq["host"], libpq["port"], libpq["dbname"]) == ("a,b", "5432,5433", "dagster")


def test_one_host_keeps_its_netloc_form() -> None:
    assert dagster_pg_url_from("postgresql://u@h:5/app") == "postgresql+psycopg2://u@h:5/dagster"


def test_yoyo_passes_every_host_to_psycopg() -> None:
    """yoyo's PostgreSQL backend gives the URI's query to psycopg.connect as keywords."""
    uri = parse_uri(with_driver(DSN, "postgresql+psycopg"))
    assert (uri.hostname, uri.port, uri.username, uri.database) == (None, None, "pin", "pin")
    assert uri.args == {
        "host": "a,b",
        "port": "5432,5433",
        "target_session_attrs": "read-write",
    }
