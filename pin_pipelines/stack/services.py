"""`pin stack up|down|status` across the services the settings point at."""

from __future__ import annotations

from typing import Any

from pin_pipelines.config import Settings
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.postgres import LocalPostgres

Result = dict[str, Any]


def _clickhouse_server_wanted(settings: Settings, flag: bool) -> bool:
    return flag or settings.clickhouse_url.startswith("clickhouse://")


def up(settings: Settings, *, clickhouse_server: bool = False) -> list[Result]:
    results = [LocalPostgres(settings).up(), LocalKafka(settings).up()]
    if _clickhouse_server_wanted(settings, clickhouse_server):
        from pin_pipelines.stack import clickhouse_server as ch

        results.append(ch.up(settings))
    return results


def down(settings: Settings, *, clickhouse_server: bool = False) -> list[Result]:
    from pin_pipelines.stack import clickhouse_server as ch

    # Down stops whatever runs, flag or not: a server left behind would hold its port.
    return [ch.down(settings), LocalKafka(settings).down(), LocalPostgres(settings).down()]


def status(settings: Settings, *, clickhouse_server: bool = False) -> list[Result]:
    from pin_pipelines.stack import clickhouse_server as ch

    return [LocalPostgres(settings).status(), LocalKafka(settings).status(), ch.status(settings)]


def describe(result: Result) -> str:
    extra = ", ".join(f"{k}={v}" for k, v in result.items() if k not in ("service", "state"))
    return f"{result['service']}: {result['state']}" + (f" ({extra})" if extra else "")
