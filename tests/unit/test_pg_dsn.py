"""Every DSN the project derives from PIN_PG_DSN keeps every parameter of it (CONTRACT section 8:
TLS and authentication hold for every connection to that server, Dagster's storage included),
for a multi-host URL too (section 9)."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

import psycopg
from sqlalchemy.dialects.postgresql.psycopg2 import dialect as psycopg2_dialect
from sqlalchemy.engine import make_url
from yoyo.connections import parse_uri

from pin_pipelines.config import (
    PG_CLIENT_DEAD_PEER_PARAMS,
    dagster_pg_dsn,
    dagster_pg_url_from,
    dsn_with_dbname,
    with_dead_peer_bounds,
    with_driver,
)
from pin_pipelines.db import connect_failure
from pin_pipelines.redact import redact_url

#: What a managed PostgreSQL behind a failover pair hands out, every TLS parameter set.
PARAMS = {
    "sslmode": "verify-full",
    "sslrootcert": "/etc/pin/pg/ca.crt",
    "sslcert": "/etc/pin/pg/client.crt",
    "sslkey": "/etc/pin/pg/client.key",
    "passfile": "/etc/pin/pg/pgpass",
    "target_session_attrs": "read-write",
}
MULTI_HOST = (
    "postgresql://pin@db-a.internal:5432,db-b.internal:5433/pin?"
    "sslmode=verify-full&sslrootcert=/etc/pin/pg/ca.crt&sslcert=/etc/pin/pg/client.crt"
    "&sslkey=/etc/pin/pg/client.key&passfile=/etc/pin/pg/pgpass&target_session_attrs=read-write"
)


def _query(url: str) -> dict[str, str]:
    return dict(parse_qsl(urlsplit(url).query))


def test_dsn_with_dbname_keeps_every_host_and_parameter() -> None:
    """Tried: the admin database of the multi-host URL. Only the path changes."""
    derived = dsn_with_dbname(MULTI_HOST, "postgres")
    assert derived == MULTI_HOST.replace("/pin?", "/postgres?")
    assert psycopg.conninfo.conninfo_to_dict(derived)["host"] == "db-a.internal,db-b.internal"


def test_with_dead_peer_bounds_adds_its_parameters_and_keeps_the_url_as_written() -> None:
    """Tried: the bounds added to the multi-host URL and to Dagster's storage URL of it: the
    original text is a prefix of the result (nothing re-encoded or dropped, a repeated `host`
    included), and every bound is there."""
    for url in (MULTI_HOST, dagster_pg_url_from(MULTI_HOST)):
        bounded = with_dead_peer_bounds(url)
        assert bounded.startswith(url + "&")
        assert PG_CLIENT_DEAD_PEER_PARAMS.items() <= _query(bounded).items()
        assert with_dead_peer_bounds(bounded) == bounded


def test_dagster_storage_url_reaches_the_same_servers_with_the_same_parameters() -> None:
    """Tried: Dagster's storage URL of the multi-host URL as SQLAlchemy's psycopg2 dialect turns
    it into psycopg2's connect arguments (what dagster-postgres' engine does): the same hosts
    and ports in order, database `dagster`, every TLS and session parameter. SQLAlchemy reads no
    host list in the authority (it failed on the port `5432,db-b.internal:5433`)."""
    url = dagster_pg_url_from(MULTI_HOST)
    _, kwargs = psycopg2_dialect().create_connect_args(make_url(with_dead_peer_bounds(url)))
    assert kwargs["host"] == "db-a.internal,db-b.internal"
    assert kwargs["port"] == "5432,5433"
    assert kwargs["dbname"] == "dagster"
    assert kwargs["user"] == "pin"
    assert PARAMS.items() <= kwargs.items()


def test_dagster_storage_url_back_to_libpq_is_the_sibling_database() -> None:
    """Tried: the storage URL of a single-host and of the multi-host URL turned back into a
    libpq URL (the project's own connections to Dagster's database): the same hosts, every
    parameter, database `dagster`."""
    for dsn in (MULTI_HOST, "postgresql://pin:secret@127.0.0.1:5/pin?sslmode=verify-full"):
        back = psycopg.conninfo.conninfo_to_dict(dagster_pg_dsn(dagster_pg_url_from(dsn)))
        assert back == {**psycopg.conninfo.conninfo_to_dict(dsn), "dbname": "dagster"}


def test_the_migrations_connect_with_every_tls_parameter() -> None:
    """Tried: yoyo's URL of the multi-host URL, read by yoyo's own parser: every TLS and session
    parameter reaches the arguments it hands to psycopg, beside the host list
    (test_pg_multihost: the hosts)."""
    uri = parse_uri(with_driver(MULTI_HOST, "postgresql+psycopg"))
    assert (uri.username, uri.database) == ("pin", "pin")
    assert PARAMS.items() <= uri.args.items()


def test_a_secured_servers_refusals_read_as_their_causes_without_the_password() -> None:
    """Tried: libpq's lines for a wrong password, an untrusted certificate and a plaintext client
    at a TLS-only server, on a URL holding a password: each PinError names the cause in an
    operator's words, keeps libpq's line, and shows no password."""
    dsn = "postgresql://pin:hunter2@127.0.0.1:5/pin?sslmode=verify-full"
    head = 'connection failed: connection to server at "127.0.0.1", port 5 failed: '
    cases = {
        'FATAL:  password authentication failed for user "pin"': (
            'authentication failed for user "pin"'
        ),
        "SSL error: certificate verify failed": "certificate not trusted",
        'FATAL:  pg_hba.conf rejects connection for host "127.0.0.1", user "pin", database '
        '"pin", no encryption': "the server requires TLS",
        'FATAL:  no pg_hba.conf entry for host "127.0.0.1", user "pin", database "pin", no '
        "encryption": "the server requires TLS",
    }
    for line, words in cases.items():
        message = str(connect_failure(dsn, psycopg.OperationalError(head + line)))
        assert message.startswith(f"PostgreSQL at {redact_url(dsn)}: {words}"), message
        assert line in message and "hunter2" not in message
