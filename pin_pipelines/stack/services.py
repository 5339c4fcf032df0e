"""`pin stack up|down|status` across the services the settings point at."""

from __future__ import annotations

import os
from typing import Any

from pin_pipelines.clickhouse.url import parse_clickhouse_url
from pin_pipelines.config import Settings
from pin_pipelines.stack.clickhouse_server import LocalClickHouseServer
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.postgres import LocalPostgres

Result = dict[str, Any]

#: The server `--clickhouse-server` manages while PIN_CLICKHOUSE_URL stays on the embedded
#: engine (CI does this: the native-protocol tests need a server beside chdb).
DEFAULT_SERVER_URL = "clickhouse://default@127.0.0.1:9000/pin_dev_stats"


def clickhouse_server(settings: Settings) -> LocalClickHouseServer:
    """The server of PIN_CLICKHOUSE_URL when it is one, else of PIN_CLICKHOUSE_SERVER_URL."""
    server = LocalClickHouseServer.from_settings(settings)
    if server is not None:
        return server
    url = os.environ.get("PIN_CLICKHOUSE_SERVER_URL") or DEFAULT_SERVER_URL
    address = parse_clickhouse_url(url)
    assert not isinstance(address, os.PathLike), "PIN_CLICKHOUSE_SERVER_URL must be clickhouse://"
    return LocalClickHouseServer(address, settings.state_dir)


def _wants_server(settings: Settings, flag: bool) -> bool:
    return flag or LocalClickHouseServer.from_settings(settings) is not None


def up(settings: Settings, *, clickhouse_server_too: bool = False) -> list[Result]:
    results = [LocalPostgres(settings).up(), LocalKafka(settings).up()]
    if _wants_server(settings, clickhouse_server_too):
        results.append(clickhouse_server(settings).up())
    return results


def down(settings: Settings, *, clickhouse_server_too: bool = False) -> list[Result]:
    # Down stops whatever runs, flag or not: a server left behind would hold its port.
    return [
        clickhouse_server(settings).down(),
        LocalKafka(settings).down(),
        LocalPostgres(settings).down(),
    ]


def status(settings: Settings, *, clickhouse_server_too: bool = False) -> list[Result]:
    results = [LocalPostgres(settings).status(), LocalKafka(settings).status()]
    if _wants_server(settings, clickhouse_server_too) or clickhouse_server(settings).status().get(
        "state"
    ) not in (None, "down", "stopped"):
        results.append(clickhouse_server(settings).status())
    return results


def describe(result: Result) -> str:
    extra = ", ".join(f"{k}={v}" for k, v in result.items() if k not in ("service", "state"))
    return f"{result['service']}: {result['state']}" + (f" ({extra})" if extra else "")
