"""What the ClickHouse client does on its own, before any server: PIN_CLICKHOUSE_URL's two forms
(clickhouse/url.py) and parameters rendered as escaped literals (clickhouse/literals.py)."""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

import pytest

from pin_pipelines.clickhouse import ClickHouseUnavailable, open_clickhouse
from pin_pipelines.clickhouse.literals import UuidSet, literal, render
from pin_pipelines.clickhouse.url import ServerAddress, parse_clickhouse_url
from pin_pipelines.errors import PinError

# --- URLs ---------------------------------------------------------------------------------------


def test_the_embedded_engine_is_an_absolute_folder() -> None:
    assert parse_clickhouse_url("chdb:///srv/pin/chdb") == Path("/srv/pin/chdb")
    assert parse_clickhouse_url("chdb:///srv/with%20space") == Path("/srv/with space")


def test_a_server_url_with_defaults_and_quoted_credentials() -> None:
    assert parse_clickhouse_url("clickhouse://ch.internal") == ServerAddress(
        "ch.internal", 9000, "default", ""
    )
    address = parse_clickhouse_url("clickhouse://ro%40x:p%2Fw@10.0.0.5:9440/pin_dev_stats")
    assert address == ServerAddress("10.0.0.5", 9440, "ro@x", "p/w")
    assert str(address) == "10.0.0.5:9440"


def test_tls_urls_take_the_drivers_parameters() -> None:
    """`clickhouses://` and `secure=true` are the same TLS connection, port 9440 by default."""
    tls = parse_clickhouse_url(
        "clickhouses://w:pw@ch:9440/pin_dev_stats?verify=true&ca_certs=/etc/ca.pem"
        "&certfile=/etc/c.pem&keyfile=/etc/c.key"
    )
    assert tls == ServerAddress(
        "ch", 9440, "w", "pw", secure=True, verify=True, ca_certs="/etc/ca.pem",
        certfile="/etc/c.pem", keyfile="/etc/c.key",
    )  # fmt: skip
    assert parse_clickhouse_url("clickhouse://ch/pin_dev_stats?secure=true&verify=false") == (
        ServerAddress("ch", 9440, "default", "", secure=True, verify=False)
    )
    assert parse_clickhouse_url("clickhouses://ch") == ServerAddress(
        "ch", 9440, "default", "", secure=True
    )


def test_the_password_file_serves_a_url_without_password(tmp_path: Path) -> None:
    """Read at each call (each connection), newline stripped; the URL's own password wins."""
    secret = tmp_path / "password"
    secret.write_text("first\n")
    address = parse_clickhouse_url("clickhouses://w@ch", password_file=secret)
    assert isinstance(address, ServerAddress) and address.current_password() == "first"
    secret.write_text("second\r\n")
    assert address.current_password() == "second"
    own = parse_clickhouse_url("clickhouses://w:mine@ch", password_file=secret)
    assert isinstance(own, ServerAddress) and own.current_password() == "mine"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("chdb://relative/dir", r"must be chdb:///absolute/dir"),
        ("clickhouse://h:9000/other_db", r"names database 'other_db'; the tables live in"),
        ("clickhouse://h:port/pin_dev_stats", r"has a bad port"),
        ("http://h:8123/pin_dev_stats", r"must be chdb:///absolute/dir or clickhouse://"),
        ("clickhouses://h/pin_dev_stats?verfy=false", r"unknown parameter 'verfy'"),
        ("clickhouse://h/pin_dev_stats?ca_certs=/ca.pem", r"ca_certs applies to TLS only"),
        ("clickhouses://h/pin_dev_stats?verify=perhaps", r"verify must be true or false"),
        ("clickhouses://h/pin_dev_stats?ca_certs=", r"ca_certs needs a file path"),
    ],
)
def test_anything_else_is_a_one_line_error(url: str, message: str) -> None:
    with pytest.raises(PinError, match=message):
        parse_clickhouse_url(url)


# --- literals -----------------------------------------------------------------------------------


def test_scalars() -> None:
    some = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert [literal(v) for v in (None, True, False, 7, -2.5, some)] == [
        "NULL",
        "1",
        "0",
        "7",
        "-2.5",
        "'12345678-1234-5678-1234-567812345678'",
    ]


def test_strings_are_escaped_so_they_cannot_end_the_literal() -> None:
    """Tried: a quote, a backslash, the control characters the escape table names."""
    assert literal("it's") == r"'it\'s'"
    assert literal("a\\b") == r"'a\\b'"
    assert literal("l1\nl2\r\t\0") == r"'l1\nl2\r\t\0'"
    assert literal("x' OR 1=1 --") == r"'x\' OR 1=1 --'"


def test_collections_become_tuples_and_sets_are_ordered() -> None:
    assert literal([1, "a", None]) == "(1, 'a', NULL)"
    assert literal((3,)) == "(3)"
    assert literal({"b", "a"}) == "('a', 'b')"
    with pytest.raises(ValueError, match="empty collection"):
        literal([])


def test_uuid_sets_are_one_string_split_by_the_engine() -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    assert literal(UuidSet([a, b])) == (f"(SELECT toUUID(arrayJoin(splitByChar(',', '{a},{b}'))))")
    with pytest.raises(ValueError, match="empty UuidSet"):
        literal(UuidSet([]))
    with pytest.raises(TypeError, match=r"uuid\.UUID values only"):
        UuidSet(["not-a-uuid"])  # type: ignore[list-item]


def test_render_fills_placeholders_and_keeps_percent_signs() -> None:
    sql = "SELECT %(n)s, %(name)s, x LIKE 'a%%' FROM t WHERE id IN %(ids)s %(settings)s"
    assert render(sql, {"n": 1, "name": "o'k", "ids": [1, 2]}, {"settings": "FINAL"}) == (
        "SELECT 1, 'o\\'k', x LIKE 'a%' FROM t WHERE id IN (1, 2) FINAL"
    )
    assert render("SELECT 'a%%'") == "SELECT 'a%%'"  # nothing to fill: the text as it is


def test_a_peer_that_never_says_hello_is_given_up_within_the_handshake_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client at a port whose listener accepts and stays silent (a TLS port that waits for a
    ClientHello, a proxy): the hello's own bound ends it, not the 60 s receive timeout, as
    unreachable (retried). The bound is shortened to keep the test short."""
    from pin_pipelines.clickhouse import server

    monkeypatch.setattr(server, "HANDSHAKE_SECONDS", 1)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody answers
        port = silent.getsockname()[1]
        started = time.monotonic()
        with (
            open_clickhouse(f"clickhouse://writer:pw@127.0.0.1:{port}/pin_dev_stats") as ch,
            pytest.raises(ClickHouseUnavailable, match=f"127.0.0.1:{port} is unreachable"),
        ):
            ch.rows("SELECT 1")
    assert time.monotonic() - started < 5
