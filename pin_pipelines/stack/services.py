"""`pin stack up|down|status` across the services the settings point at."""

from __future__ import annotations

import os
from typing import Any

from pin_pipelines.clickhouse import parse_clickhouse_url
from pin_pipelines.config import Settings
from pin_pipelines.stack.clickhouse_cluster import LocalClickHouseCluster
from pin_pipelines.stack.clickhouse_server import LocalClickHouseServer
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.kafka_cluster import LocalKafkaCluster
from pin_pipelines.stack.postgres import LocalPostgres
from pin_pipelines.stack.secure import SecuredEstate

Result = dict[str, Any]


def _url_names_local_cluster(settings: Settings) -> bool:
    """PIN_CLICKHOUSE_CLUSTER with a loopback server URL: the URL is a server of the local
    cluster (`--clickhouse-cluster`), not a single server to start on its port."""
    server = LocalClickHouseServer.from_settings(settings)
    return settings.clickhouse_cluster is not None and server is not None and server.is_local


def clickhouse_server(settings: Settings) -> LocalClickHouseServer:
    """The server of PIN_CLICKHOUSE_URL when it is one (a single server, or a remote cluster's
    server to check), else of PIN_CLICKHOUSE_SERVER_URL."""
    server = LocalClickHouseServer.from_settings(settings)
    if server is not None and not _url_names_local_cluster(settings):
        return server
    address = parse_clickhouse_url(settings.clickhouse_server_url)
    assert not isinstance(address, os.PathLike), "PIN_CLICKHOUSE_SERVER_URL must be clickhouse://"
    return LocalClickHouseServer(address, settings.state_dir)


def _wants_server(settings: Settings, flag: bool) -> bool:
    url_server = LocalClickHouseServer.from_settings(settings)
    return flag or (url_server is not None and not _url_names_local_cluster(settings))


def _wants_cluster(settings: Settings, flag: bool) -> bool:
    return flag or _url_names_local_cluster(settings)


def _kafka_cluster(settings: Settings, brokers: int | None) -> LocalKafkaCluster | None:
    """The local Kafka cluster to manage: asked for (`--kafka-brokers N`, N > 1), or without the
    flag the one that runs; None: the single broker (the default)."""
    if brokers is not None:
        return LocalKafkaCluster(settings, brokers) if brokers > 1 else None
    cluster = LocalKafkaCluster(settings)
    return cluster if cluster.is_running() else None


def _kafka_up(settings: Settings, brokers: int | None) -> list[Result]:
    cluster = _kafka_cluster(settings, brokers)
    return cluster.up() if cluster is not None else [LocalKafka(settings).up()]


def up(
    settings: Settings,
    *,
    clickhouse_server_too: bool = False,
    clickhouse_cluster: bool = False,
    kafka_brokers: int | None = None,
    secure: bool = False,
) -> list[Result]:
    if secure:  # an estate of its own, beside the plain stack (stack/secure.py)
        return SecuredEstate(settings).up()
    results = [LocalPostgres(settings).up(), *_kafka_up(settings, kafka_brokers)]
    if _wants_server(settings, clickhouse_server_too):
        results.append(clickhouse_server(settings).up())
    if _wants_cluster(settings, clickhouse_cluster):
        results += LocalClickHouseCluster.from_settings(settings).up()
    return results


def down(
    settings: Settings,
    *,
    clickhouse_server_too: bool = False,
    clickhouse_cluster: bool = False,
    kafka_brokers: int | None = None,
    secure: bool = False,
) -> list[Result]:
    if secure:  # the secured estate alone: the plain stack beside it keeps running
        return SecuredEstate(settings).down()
    # Down stops whatever runs, flags or not: a server left behind would hold its port.
    cluster = LocalClickHouseCluster.from_settings(settings)
    results = cluster.down() if clickhouse_cluster or cluster.is_running() else []
    return [
        *SecuredEstate(settings).down(),
        *results,
        clickhouse_server(settings).down(),
        *LocalKafkaCluster(settings).down(),
        LocalKafka(settings).down(),
        LocalPostgres(settings).down(),
    ]


def status(
    settings: Settings,
    *,
    clickhouse_server_too: bool = False,
    clickhouse_cluster: bool = False,
    kafka_brokers: int | None = None,
    secure: bool = False,
) -> list[Result]:
    estate = SecuredEstate(settings)
    if secure:
        return estate.status()
    plain = _plain_status(settings, clickhouse_server_too, clickhouse_cluster, kafka_brokers)
    return [*plain, *estate.status()] if estate.is_running() else plain


def _plain_status(
    settings: Settings,
    clickhouse_server_too: bool,
    clickhouse_cluster: bool,
    kafka_brokers: int | None,
) -> list[Result]:
    kafka = _kafka_cluster(settings, kafka_brokers)
    results = [
        LocalPostgres(settings).status(),
        *(kafka.status() if kafka is not None else [LocalKafka(settings).status()]),
    ]
    if _wants_server(settings, clickhouse_server_too) or clickhouse_server(settings).status().get(
        "state"
    ) not in (None, "down", "stopped"):
        results.append(clickhouse_server(settings).status())
    cluster = LocalClickHouseCluster.from_settings(settings)
    if _wants_cluster(settings, clickhouse_cluster) or cluster.is_running():
        results += cluster.status()
    return results


def describe(result: Result) -> str:
    extra = ", ".join(f"{k}={v}" for k, v in result.items() if k not in ("service", "state"))
    return f"{result['service']}: {result['state']}" + (f" ({extra})" if extra else "")
