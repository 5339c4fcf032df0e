"""The read API's settings (config.py): PIN_API_ADDR, PIN_API_PORT,
PIN_API_METRICS_PORT, PIN_API_JWKS_URL, PIN_API_ISSUER, PIN_API_AUDIENCE — defaults, read, and a
bad value refused in one line for every command (the other settings' tests: test_settings.py).
Only mappings are parsed; the metrics listener is tried in-process on a port in use (the whole
`pin api serve`: tests/integration/test_api_serve.py)."""

from __future__ import annotations

import socket

import pytest

from pin_pipelines.api.observe import ApiMetrics
from pin_pipelines.api.server import serve_metrics
from pin_pipelines.config import Settings
from pin_pipelines.errors import PinError

STATE = {"PIN_STATE_DIR": "/srv/pin-state"}


def test_the_api_listens_on_loopback_8090_and_trusts_nobody_by_default() -> None:
    """Its /metrics on a port of its own, 8091."""
    settings = Settings.from_env(STATE)
    assert (settings.api_addr, settings.api_port, settings.api_metrics_port) == (
        "127.0.0.1",
        8090,
        8091,
    )
    assert (settings.api_jwks_url, settings.api_issuer, settings.api_audience) == (None,) * 3


def test_every_api_variable_is_read() -> None:
    env = {
        **STATE,
        "PIN_API_ADDR": "0.0.0.0",
        "PIN_API_PORT": "9443",
        "PIN_API_METRICS_PORT": "9444",
        "PIN_API_JWKS_URL": "https://idp.example/.well-known/jwks.json",
        "PIN_API_ISSUER": "https://idp.example/",
        "PIN_API_AUDIENCE": "pin-dev-stats",
    }
    s = Settings.from_env(env)
    assert (s.api_addr, s.api_port, s.api_metrics_port) == ("0.0.0.0", 9443, 9444)
    assert (s.api_jwks_url, s.api_issuer, s.api_audience) == (
        env["PIN_API_JWKS_URL"],
        "https://idp.example/",
        "pin-dev-stats",
    )
    assert Settings.from_env({**STATE, "PIN_API_JWKS_URL": "http://127.0.0.1:1/k"}).api_jwks_url


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PIN_API_PORT": "api"}, r"^PIN_API_PORT must be a port number, got 'api'$"),
        ({"PIN_API_PORT": "0"}, r"^PIN_API_PORT must be a port number"),
        (
            {"PIN_API_METRICS_PORT": "metrics"},
            r"^PIN_API_METRICS_PORT must be a port number, got 'metrics'$",
        ),
        ({"PIN_API_METRICS_PORT": "65536"}, r"^PIN_API_METRICS_PORT must be a port number"),
        (
            {"PIN_API_METRICS_PORT": "8090"},
            r"^PIN_API_METRICS_PORT must differ from PIN_API_PORT, both are 8090$",
        ),
        (
            {"PIN_API_PORT": "9000", "PIN_API_METRICS_PORT": "9000"},
            r"^PIN_API_METRICS_PORT must differ from PIN_API_PORT, both are 9000$",
        ),
        ({"PIN_API_PORT": "8091"}, r"^PIN_API_METRICS_PORT must differ from PIN_API_PORT"),
        ({"PIN_API_JWKS_URL": "ftp://idp/jwks"}, r"^PIN_API_JWKS_URL must be an http:// or https"),
        ({"PIN_API_JWKS_URL": "idp.example/jwks"}, r"^PIN_API_JWKS_URL must be an http://"),
        ({"PIN_API_JWKS_URL": "https:///jwks"}, r"^PIN_API_JWKS_URL must be an http://"),
    ],
)
def test_a_bad_api_value_is_refused_in_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(PinError, match=message) as raised:
        Settings.from_env({**STATE, **env})
    assert "\n" not in str(raised.value)


def test_a_metrics_port_in_use_is_refused_in_one_line() -> None:
    """`serve_metrics` (what `pin api serve` starts beside uvicorn; its answers and its stop:
    test_api_serve.py) on a port another socket listens on: one line naming the setting."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PinError) as raised:
            serve_metrics(ApiMetrics(), "127.0.0.1", port)
    message = str(raised.value)
    assert message.startswith(f"cannot listen on 127.0.0.1:{port} for /metrics")
    assert "PIN_API_METRICS_PORT" in message and "\n" not in message
