"""Every error path reachable without a server, built with a password in the URL it reports on:
the password appears in none of their messages, reprs or log lines (CONTRACT section 8). The
refusals that need a server (a wrong password, an untrusted certificate, a plaintext client at a
TLS port) are in tests/integration/test_clickhouse_secured.py."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from pin_pipelines.api.jwks import fetch_jwks
from pin_pipelines.cli import main
from pin_pipelines.clickhouse import ServerAddress, open_clickhouse, parse_clickhouse_url
from pin_pipelines.config import PgTarget, Settings
from pin_pipelines.db import connect
from pin_pipelines.errors import PinError
from pin_pipelines.logs import log_event
from pin_pipelines.stack.process import free_port

SECRET = "s3cr3t-Pw"
CH = f"clickhouse://writer:{SECRET}@127.0.0.1:{{port}}/pin_dev_stats"


@pytest.mark.parametrize(
    "url",
    [
        CH.format(port=9000) + "?verfy=false",  # an unknown parameter
        CH.format(port=9000) + "?verify=true",  # a TLS parameter without TLS
        CH.format(port=9000).replace("clickhouse:", "clickhouses:") + "?verify=maybe",
        CH.format(port=9000).replace("9000", "port"),
        CH.format(port=9000).replace("clickhouse:", "clickhous:"),
        CH.format(port=9000).replace("pin_dev_stats", "other_db"),
    ],
)
def test_a_refused_clickhouse_url_is_shown_without_its_password(url: str) -> None:
    """Each of url.py's refusals, with the password in the URL's user info."""
    with pytest.raises(PinError) as refused:
        parse_clickhouse_url(url)
    assert SECRET not in str(refused.value)
    assert "\n" not in str(refused.value)


def test_an_unreachable_clickhouse_server_is_named_without_the_password() -> None:
    """A TLS URL at a port where nothing listens: refused connection, PinError naming host:port."""
    url = CH.format(port=free_port()).replace("clickhouse:", "clickhouses:")
    with open_clickhouse(url) as ch, pytest.raises(PinError) as refused:
        ch.rows("SELECT 1")
    assert f"127.0.0.1:{url.split(':')[-1].split('/')[0]}" in str(refused.value)
    assert SECRET not in str(refused.value)


def test_addresses_and_settings_keep_passwords_out_of_their_repr(tmp_path: Path) -> None:
    """A repr lands in tracebacks' locals, debug prints and Dagster metadata."""
    address = parse_clickhouse_url(CH.format(port=9440))
    assert isinstance(address, ServerAddress) and address.password == SECRET
    settings = Settings.from_env(
        {
            "PIN_PG_DSN": f"postgresql://pin:{SECRET}@127.0.0.1:5432/pin",
            "PIN_CLICKHOUSE_URL": CH.format(port=9440),
            "PIN_STATE_DIR": str(tmp_path),
        }
    )
    assert SECRET not in repr(address) and SECRET not in str(address)
    assert SECRET not in repr(settings)


def test_a_missing_password_file_is_named_without_any_secret(tmp_path: Path) -> None:
    """PIN_CLICKHOUSE_PASSWORD_FILE that does not exist: one line naming the file."""
    missing = tmp_path / "gone.password"
    address = parse_clickhouse_url(
        CH.format(port=9440).replace(f":{SECRET}", ""), password_file=missing
    )
    assert isinstance(address, ServerAddress)
    with pytest.raises(
        PinError, match=r"cannot read PIN_CLICKHOUSE_PASSWORD_FILE .*gone\.password"
    ):
        address.current_password()


@pytest.mark.parametrize(
    "fail",
    [
        lambda: PgTarget.parse(f"mysql://pin:{SECRET}@h/pin"),
        lambda: PgTarget.parse(f"postgresql://pin:{SECRET}@h:port/pin"),
        lambda: connect(
            f"postgresql://pin:{SECRET}@127.0.0.1:{free_port()}/pin", connect_timeout=2
        ),
        lambda: Settings.from_env({"PIN_API_JWKS_URL": f"ftp://u:{SECRET}@idp/jwks"}),
        lambda: fetch_jwks(f"http://u:{SECRET}@127.0.0.1:{free_port()}/jwks", timeout=2),
    ],
    ids=["pg-scheme", "pg-port", "pg-unreachable", "jwks-setting", "jwks-unreachable"],
)
def test_other_services_urls_are_shown_without_their_password(fail: Callable[[], object]) -> None:
    """PostgreSQL's DSN and the JWKS URL in the errors that quote them."""
    with pytest.raises(PinError) as refused:
        fail()
    assert SECRET not in str(refused.value)


def test_a_log_line_quoting_a_url_is_redacted(caplog: pytest.LogCaptureFixture) -> None:
    """Whatever a log field holds, e.g. an error message quoting a driver's URL."""
    with caplog.at_level(logging.INFO, logger="pin_pipelines.test"):
        log_event(logging.getLogger("pin_pipelines.test"), "x", error=CH.format(port=9000))
    assert caplog.records and SECRET not in caplog.text


def test_the_cli_prints_a_refused_url_without_its_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pin devstats labels` with a misspelt TLS parameter: exit 1, one line, no password."""
    monkeypatch.setenv("PIN_CLICKHOUSE_URL", CH.format(port=9440) + "?bogus=1")
    code = main(["devstats", "labels", "--developer-id", "00000000-0000-0000-0000-000000000001",
                 "--ids", "00000000-0000-0000-0000-000000000002"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code != 0
    assert "unknown parameter 'bogus'" in err and err.count("\n") == 1
    assert SECRET not in out + err
