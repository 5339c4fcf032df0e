"""Settings from the environment (the contract's section 1); nothing is read from a config file."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from pin_pipelines.errors import PinError
from pin_pipelines.redact import redact_url

DEFAULT_PG_DSN = "postgresql://postgres@127.0.0.1:5432/pin"
DEFAULT_KAFKA_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_METRICS_ADDR = "127.0.0.1"
DEFAULT_METRICS_PORT = 9108
#: `pin api serve` (CONTRACT section 7): loopback unless told otherwise, like the exporter.
DEFAULT_API_ADDR = "127.0.0.1"
DEFAULT_API_PORT = 8090
#: The API's Prometheus /metrics: a listener of its own, on PIN_API_ADDR (no token there).
DEFAULT_API_METRICS_PORT = 8091
DEFAULT_RECALC_MAX_DRAIN_RUNS = 2
#: Spec 000: the worker ticks every 5 s (the recalc sensor's interval; the alert rules' unit).
DEFAULT_RECALC_TICK_SECONDS = 5
#: Followed by the database's name: two outboxes publishing to one Kafka cluster (staging and a
#: benchmark on a shared broker) must not fence each other's relays.
RELAY_TRANSACTIONAL_ID_PREFIX = "pin-outbox-relay"
#: The relay wakes on the outbox's notification; it looks at the outbox unwoken this often too,
#: for a notification lost with its listening session (a failover, a restart). At most
#: MAX_RELAY_BACKSTOP_SECONDS: half the relay session's idle timeout (relay/outbox.py), which
#: the backstop's statements keep from ending it.
DEFAULT_RELAY_BACKSTOP_SECONDS = 5.0
MAX_RELAY_BACKSTOP_SECONDS = 60.0
DEFAULT_KAFKA_PARTITIONS = 6
#: min.compaction.lag.ms of the changelog topics: every version stays readable for a week before
#: compaction may drop it for a newer one of the same key (a loader down for days replays them).
DEFAULT_KAFKA_MIN_COMPACTION_LAG_MS = 7 * 24 * 3600 * 1000
DEFAULT_DEVSTATS_MAX_LOAD_RUNS = 1
#: How long one long-lived relay or load run runs before its successor takes over. Each
#: hand-over starts a run worker (~1.7 CPU-seconds here; a Kubernetes Job and pod in deploy/) and
#: writes a run's ~20 event-log rows whatever its length: 10 minutes halves both against 5, and
#: stays below run monitoring's max_runtime_seconds (900) with the margin (docs/production.md,
#: "Hand-overs of the long runs"). At least MIN_LONG_RUN_SECONDS: more than the longest hand-over
#: margin (defs/handover.py, MAX_HANDOVER_SECONDS), or every run's successor would be launched at
#: once.
DEFAULT_LONG_RUN_SECONDS = 600
MIN_LONG_RUN_SECONDS = 60
#: The server `pin stack up --clickhouse-server` manages while PIN_CLICKHOUSE_URL stays on the
#: embedded engine (CI does this: the native-protocol tests need a server beside chdb).
DEFAULT_CLICKHOUSE_SERVER_URL = "clickhouse://default@127.0.0.1:9000/pin_dev_stats"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", ""})
#: A ClickHouse cluster name goes into DDL unquoted (`ON CLUSTER name`, `Distributed(name, …)`).
_CLUSTER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

#: A peer silent this long (no answer, no TCP acknowledgement, no keepalive answered) is dead: the
#: one bound of every PostgreSQL connection, both ends. Without it a blackholed peer
#: (a host that lost its network: no RST, no FIN) is waited for until the kernel's retransmission
#: timeout, ~15 min, and the server keeps the dead client's session and its row locks as long. A
#: live peer's kernel acknowledges within milliseconds whatever its process is doing, so a long
#: statement or a slow client never reaches the bound.
DEAD_PEER_SECONDS = 15
#: TCP keepalive (idle seconds, interval seconds, probes): a connection waiting for an answer
#: from a peer that went silent ends after idle + probes × interval = 11 s. PostgreSQL (both
#: ends) and the ClickHouse server's clients use it; librdkafka has keepalive on/off only.
TCP_KEEPALIVE = (DEAD_PEER_SECONDS // 3, 2, 3)
_KEEPALIVE_IDLE_SECONDS, _KEEPALIVE_INTERVAL_SECONDS, _KEEPALIVE_COUNT = TCP_KEEPALIVE
#: The client's side, as libpq parameters: added to every connection string the project uses
#: where it sets none of its own (a DSN's own `?tcp_user_timeout=…` wins), Dagster's storage URL
#: included. keepalives end a connection that waits for an answer; tcp_user_timeout one whose
#: sent data is never acknowledged.
PG_CLIENT_DEAD_PEER_PARAMS = {
    "keepalives": "1",
    "keepalives_idle": str(_KEEPALIVE_IDLE_SECONDS),
    "keepalives_interval": str(_KEEPALIVE_INTERVAL_SECONDS),
    "keepalives_count": str(_KEEPALIVE_COUNT),
    "tcp_user_timeout": str(DEAD_PEER_SECONDS * 1000),
}
#: The server's side (postgresql.conf; `pin stack up` writes them, an external server needs them
#: set by its operator, docs/runbook.md "Network partitions"): a backend whose client vanished
#: ends within the bound, rolling its transaction back and freeing its row locks, also in the
#: middle of a statement (client_connection_check_interval sees the socket the keepalives
#: failed), so a healthy drain can take the project over.
PG_SERVER_DEAD_PEER_SETTINGS = {
    "tcp_keepalives_idle": str(_KEEPALIVE_IDLE_SECONDS),
    "tcp_keepalives_interval": str(_KEEPALIVE_INTERVAL_SECONDS),
    "tcp_keepalives_count": str(_KEEPALIVE_COUNT),
    "tcp_user_timeout": str(DEAD_PEER_SECONDS * 1000),
    "client_connection_check_interval": "2000",
}

#: The repository root when the package runs from a checkout (the normal case, editable install).
SOURCE_ROOT = Path(__file__).resolve().parents[1]
#: Migrations, DDL and named queries: SQL is kept as `.sql` files, not strings in Python.
SQL_DIR = SOURCE_ROOT / "sql"


def _default_state_dir() -> Path:
    if (SOURCE_ROOT / "pyproject.toml").exists():
        return SOURCE_ROOT / ".pin"
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "pin"


@dataclass(frozen=True)
class Settings:
    #: The URLs may hold passwords: kept out of the repr (a traceback's locals, a debug print).
    pg_dsn: str = field(repr=False)
    kafka_bootstrap: str
    clickhouse_url: str = field(repr=False)
    #: PIN_CLICKHOUSE_CLUSTER: the `remote_servers` cluster `pin db migrate` creates the dimension
    #: on (`ON CLUSTER`, a Distributed table over replicated local tables); None: one node.
    clickhouse_cluster: str | None
    state_dir: Path
    dagster_home: Path
    dagster_port: int
    dagster_pg_url: str = field(repr=False)
    #: Concurrent recalc_drain_job runs (PIN_RECALC_MAX_DRAIN_RUNS): the sensor launches no more,
    #: and the run queue of the Dagster instance that `pin serve` prepares admits no more.
    recalc_max_drain_runs: int
    #: PIN_RECALC_TICK_SECONDS: the recalc scheduler's interval (whole seconds ≥ 1); the worker
    #: liveness alerts count missed ticks in it (`pin metrics rules`).
    recalc_tick_seconds: int
    #: The outbox relay's Kafka `transactional.id`: stable, so a new relay fences the one before it.
    #: One per outbox; two outboxes on one Kafka cluster need two.
    relay_transactional_id: str
    #: Finished Dagster runs are deleted, with their event and compute logs, this many days after
    #: they ended: successes (PIN_DAGSTER_RETENTION_SUCCESS_DAYS) and failed or canceled runs
    #: (PIN_DAGSTER_RETENTION_FAILURE_DAYS).
    dagster_retention_success_days: float
    dagster_retention_failure_days: float
    #: `pin metrics serve`: the exporter's address and port (PIN_METRICS_ADDR, PIN_METRICS_PORT).
    metrics_addr: str
    metrics_port: int
    #: Topics `pin db migrate` (and the relay) create: partitions (PIN_KAFKA_PARTITIONS),
    #: replication factor (PIN_KAFKA_REPLICATION_FACTOR; None: min(3, brokers of the cluster)) and
    #: min.insync.replicas (PIN_KAFKA_MIN_INSYNC_REPLICAS; None: replication factor − 1, ≥ 1).
    #: None is resolved against the cluster at creation time (pin_pipelines/kafka.py, TopicPolicy).
    kafka_partitions: int = DEFAULT_KAFKA_PARTITIONS
    kafka_replication_factor: int | None = None
    kafka_min_insync_replicas: int | None = None
    #: min.compaction.lag.ms of the compacted changelog topics (PIN_KAFKA_MIN_COMPACTION_LAG_MS).
    kafka_min_compaction_lag_ms: int = DEFAULT_KAFKA_MIN_COMPACTION_LAG_MS
    #: Concurrent dim_layout_group loads (PIN_DEVSTATS_MAX_LOAD_RUNS): the sensor launches no more,
    #: the run queue admits no more. Each is a consumer of the loader's group; more than one only
    #: on a ClickHouse server (the embedded engine admits one process per folder).
    devstats_max_load_runs: int = DEFAULT_DEVSTATS_MAX_LOAD_RUNS
    #: PIN_LONG_RUN_SECONDS: the budget the sensors give each relay and load run they launch.
    long_run_seconds: int = DEFAULT_LONG_RUN_SECONDS
    #: PIN_RELAY_BACKSTOP_SECONDS: the longest a relay waits without a notification before it
    #: looks at the outbox anyway.
    relay_backstop_seconds: float = DEFAULT_RELAY_BACKSTOP_SECONDS
    #: PIN_CLICKHOUSE_SERVER_URL: the server `pin stack up|status|down --clickhouse-server`
    #: manages when PIN_CLICKHOUSE_URL does not name one (it is chdb, or a cluster's server).
    clickhouse_server_url: str = field(default=DEFAULT_CLICKHOUSE_SERVER_URL, repr=False)
    #: `pin api serve` (CONTRACT section 7): where it listens (PIN_API_ADDR, PIN_API_PORT) and
    #: whose tokens it accepts: signed by a key of the identity provider's JWKS (PIN_API_JWKS_URL,
    #: http(s)), issued by PIN_API_ISSUER for PIN_API_AUDIENCE. None: unset; only `pin api serve`
    #: needs them, and it refuses to start without them.
    api_addr: str = DEFAULT_API_ADDR
    api_port: int = DEFAULT_API_PORT
    #: PIN_API_METRICS_PORT: where `pin api serve` serves its /metrics, on PIN_API_ADDR too (not
    #: PIN_API_PORT: every request there but /healthz and /openapi.json needs a token).
    api_metrics_port: int = DEFAULT_API_METRICS_PORT
    api_jwks_url: str | None = None
    api_issuer: str | None = None
    api_audience: str | None = None
    #: PIN_CLICKHOUSE_PASSWORD_FILE: the ClickHouse password of a URL without one, read at each
    #: connection (a Kubernetes secret mounted as a file; a rotated one counts from the next).
    clickhouse_password_file: Path | None = None
    #: PIN_CODE_SERVER_PORT: the loopback port of the code server `pin serve` and `pin dev` run
    #: for the daemon and the webserver (serve.py). None: a free port chosen at each start, so
    #: that two instances on one machine never clash.
    code_server_port: int | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        state_dir = Path(e.get("PIN_STATE_DIR") or _default_state_dir()).resolve()
        pg_dsn = e.get("PIN_PG_DSN") or DEFAULT_PG_DSN
        clickhouse_url = e.get("PIN_CLICKHOUSE_URL") or f"chdb://{state_dir / 'chdb'}"
        clickhouse_cluster = e.get("PIN_CLICKHOUSE_CLUSTER") or None
        if clickhouse_cluster is not None and not _CLUSTER_NAME.fullmatch(clickhouse_cluster):
            raise PinError(
                "PIN_CLICKHOUSE_CLUSTER must be a cluster name of remote_servers (letters, digits, "
                f"underscores), got {clickhouse_cluster!r}"
            )
        port = e.get("PIN_DAGSTER_PORT") or "3000"
        if not port.isdigit():
            raise PinError(f"PIN_DAGSTER_PORT must be a port number, got {port!r}")
        drain_runs = e.get("PIN_RECALC_MAX_DRAIN_RUNS") or str(DEFAULT_RECALC_MAX_DRAIN_RUNS)
        if not drain_runs.isdecimal() or int(drain_runs) < 1:
            raise PinError(
                f"PIN_RECALC_MAX_DRAIN_RUNS must be a whole number ≥ 1, got {drain_runs!r}"
            )
        return cls(
            pg_dsn=pg_dsn,
            kafka_bootstrap=e.get("PIN_KAFKA_BOOTSTRAP") or DEFAULT_KAFKA_BOOTSTRAP,
            clickhouse_url=clickhouse_url,
            clickhouse_cluster=clickhouse_cluster,
            state_dir=state_dir,
            dagster_home=Path(e.get("DAGSTER_HOME") or state_dir / "dagster_home"),
            dagster_port=int(port),
            dagster_pg_url=e.get("PIN_DAGSTER_PG_URL") or dagster_pg_url_from(pg_dsn),
            recalc_max_drain_runs=int(drain_runs),
            recalc_tick_seconds=recalc_tick_seconds(e),
            relay_transactional_id=e.get("PIN_RELAY_TRANSACTIONAL_ID")
            or f"{RELAY_TRANSACTIONAL_ID_PREFIX}-{PgTarget.parse(pg_dsn).dbname}",
            relay_backstop_seconds=_relay_backstop_seconds(e),
            dagster_retention_success_days=_days(e, "PIN_DAGSTER_RETENTION_SUCCESS_DAYS", 3.0),
            dagster_retention_failure_days=_days(e, "PIN_DAGSTER_RETENTION_FAILURE_DAYS", 14.0),
            metrics_addr=e.get("PIN_METRICS_ADDR") or DEFAULT_METRICS_ADDR,
            metrics_port=_port(e, "PIN_METRICS_PORT", DEFAULT_METRICS_PORT),
            kafka_partitions=_whole(e, "PIN_KAFKA_PARTITIONS") or DEFAULT_KAFKA_PARTITIONS,
            kafka_replication_factor=_whole(e, "PIN_KAFKA_REPLICATION_FACTOR"),
            kafka_min_insync_replicas=_whole(e, "PIN_KAFKA_MIN_INSYNC_REPLICAS"),
            kafka_min_compaction_lag_ms=_whole(e, "PIN_KAFKA_MIN_COMPACTION_LAG_MS")
            or DEFAULT_KAFKA_MIN_COMPACTION_LAG_MS,
            devstats_max_load_runs=_load_runs(e, clickhouse_url),
            long_run_seconds=_long_run_seconds(e),
            clickhouse_server_url=e.get("PIN_CLICKHOUSE_SERVER_URL")
            or DEFAULT_CLICKHOUSE_SERVER_URL,
            api_addr=e.get("PIN_API_ADDR") or DEFAULT_API_ADDR,
            api_port=_port(e, "PIN_API_PORT", DEFAULT_API_PORT),
            api_metrics_port=_api_metrics_port(e),
            api_jwks_url=_http_url(e, "PIN_API_JWKS_URL"),
            api_issuer=e.get("PIN_API_ISSUER") or None,
            api_audience=e.get("PIN_API_AUDIENCE") or None,
            clickhouse_password_file=Path(e["PIN_CLICKHOUSE_PASSWORD_FILE"])
            if e.get("PIN_CLICKHOUSE_PASSWORD_FILE")
            else None,
            code_server_port=_code_server_port(e, int(port)),
        )

    @property
    def pg(self) -> PgTarget:
        return PgTarget.parse(self.pg_dsn)

    @property
    def kafka_host_port(self) -> tuple[str, int]:
        first = self.kafka_bootstrap.split(",")[0].strip()
        host, _, port = first.rpartition(":")
        if not host or not port.isdigit():
            raise PinError(f"PIN_KAFKA_BOOTSTRAP must be host:port[,host:port], got {first!r}")
        return host, int(port)

    @property
    def kafka_is_local(self) -> bool:
        return self.kafka_host_port[0] in LOOPBACK_HOSTS


def traceback_requested(env: Mapping[str, str] | None = None) -> bool:
    """PIN_DEBUG: `pin` prints the traceback of an unexpected error under its one-line message.
    Apart from Settings: it is asked when reading the settings may itself have failed."""
    return bool((os.environ if env is None else env).get("PIN_DEBUG"))


def _whole(env: Mapping[str, str], name: str) -> int | None:
    """A whole number ≥ 1, or None when unset (the default applies)."""
    raw = env.get(name)
    if not raw:
        return None
    if not raw.isdecimal() or int(raw) < 1:
        raise PinError(f"{name} must be a whole number ≥ 1, got {raw!r}")
    return int(raw)


def recalc_tick_seconds(env: Mapping[str, str]) -> int:
    """PIN_RECALC_TICK_SECONDS, apart from Settings: the sensor's interval is fixed when the
    definitions load, before any setting is read at run time."""
    return _whole(env, "PIN_RECALC_TICK_SECONDS") or DEFAULT_RECALC_TICK_SECONDS


def _load_runs(env: Mapping[str, str], clickhouse_url: str) -> int:
    """PIN_DEVSTATS_MAX_LOAD_RUNS; above 1 only on a ClickHouse server: the embedded engine's
    folder admits one process, so a second loader there would fail, not help."""
    runs = _whole(env, "PIN_DEVSTATS_MAX_LOAD_RUNS") or DEFAULT_DEVSTATS_MAX_LOAD_RUNS
    if runs > 1 and clickhouse_url.startswith("chdb://"):
        raise PinError(
            f"PIN_DEVSTATS_MAX_LOAD_RUNS={runs} needs a ClickHouse server (PIN_CLICKHOUSE_URL="
            "clickhouse://…): the embedded chdb admits one loader process per folder"
        )
    return runs


def _relay_backstop_seconds(env: Mapping[str, str]) -> float:
    raw = env.get("PIN_RELAY_BACKSTOP_SECONDS")
    if not raw:
        return DEFAULT_RELAY_BACKSTOP_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= MAX_RELAY_BACKSTOP_SECONDS:
        raise PinError(
            "PIN_RELAY_BACKSTOP_SECONDS must be a number of seconds above 0 and at most "
            f"{MAX_RELAY_BACKSTOP_SECONDS:g}, got {raw!r}"
        )
    return seconds


def _long_run_seconds(env: Mapping[str, str]) -> int:
    seconds = _whole(env, "PIN_LONG_RUN_SECONDS") or DEFAULT_LONG_RUN_SECONDS
    if seconds < MIN_LONG_RUN_SECONDS:
        raise PinError(
            f"PIN_LONG_RUN_SECONDS must be at least {MIN_LONG_RUN_SECONDS} (a run outlasts its "
            f"successor's launch), got {seconds}"
        )
    return seconds


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name) or str(default)
    if not raw.isdecimal() or not 0 < int(raw) < 65536:
        raise PinError(f"{name} must be a port number, got {raw!r}")
    return int(raw)


def _api_metrics_port(env: Mapping[str, str]) -> int:
    """PIN_API_METRICS_PORT, never PIN_API_PORT: the two are two listeners of one process."""
    port = _port(env, "PIN_API_METRICS_PORT", DEFAULT_API_METRICS_PORT)
    if port == _port(env, "PIN_API_PORT", DEFAULT_API_PORT):
        raise PinError(f"PIN_API_METRICS_PORT must differ from PIN_API_PORT, both are {port}")
    return port


def _code_server_port(env: Mapping[str, str], dagster_port: int) -> int | None:
    """PIN_CODE_SERVER_PORT, never the webserver's port; None when unset."""
    if not env.get("PIN_CODE_SERVER_PORT"):
        return None
    port = _port(env, "PIN_CODE_SERVER_PORT", 0)
    if port == dagster_port:
        raise PinError(f"PIN_CODE_SERVER_PORT must differ from PIN_DAGSTER_PORT, both are {port}")
    return port


def _http_url(env: Mapping[str, str], name: str) -> str | None:
    """An http:// or https:// URL with a host, or None when unset."""
    raw = env.get(name)
    if not raw:
        return None
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PinError(f"{name} must be an http:// or https:// URL, got {redact_url(raw)!r}")
    return raw


def _days(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name) or str(default)
    try:
        days = float(raw)
    except ValueError:
        days = -1.0
    if not days > 0:
        raise PinError(f"{name} must be a number of days > 0, got {raw!r}")
    return days


@dataclass(frozen=True)
class PgTarget:
    """The parts of a libpq URL that the local stack needs to own a cluster for it. A URL may
    name several hosts (`a:5432,b:5433`, libpq tries them in turn): `host`/`port` are the
    first, `more_hosts` the others."""

    host: str
    port: int
    user: str
    dbname: str
    more_hosts: tuple[tuple[str, int], ...] = ()

    @classmethod
    def parse(cls, dsn: str) -> PgTarget:
        parts = urlsplit(dsn)
        if parts.scheme not in ("postgresql", "postgres"):
            raise PinError(f"PIN_PG_DSN must be a postgresql:// URL, got {redact_url(dsn)!r}")
        userinfo, _, _ = parts.netloc.rpartition("@")
        (host, port), *more = pg_hosts(dsn) or [("127.0.0.1", 5432)]
        return cls(
            host=host or "127.0.0.1",
            port=port,
            user=unquote(userinfo.partition(":")[0]) or "postgres",
            dbname=parts.path.lstrip("/") or "pin",
            more_hosts=tuple(more),
        )

    @property
    def address(self) -> str:
        """Every host:port, as an operator reads them in a message."""
        return ",".join(f"{h}:{p}" for h, p in ((self.host, self.port), *self.more_hosts))

    @property
    def is_local(self) -> bool:
        """One loopback host: a cluster the stack can own. Several hosts are a primary and its
        standbys, run by their operator."""
        return not self.more_hosts and self.host in LOOPBACK_HOSTS


def pg_hosts(dsn: str) -> list[tuple[str, int]]:
    """The host:port pairs of a libpq URL's netloc, in order (`[::1]:5432` too); a host without
    a port gets 5432."""
    hostlist = urlsplit(dsn).netloc.rpartition("@")[2]
    found = []
    for entry in hostlist.split(",") if hostlist else []:
        if entry.startswith("["):
            host, _, rest = entry[1:].partition("]")
            port = rest.removeprefix(":")
        else:
            host, _, port = entry.partition(":")
        if port and not (port.isdecimal() and 0 < int(port) < 65536):
            raise PinError(f"PIN_PG_DSN has a bad port: {redact_url(dsn)!r}")
        found.append((unquote(host), int(port or 5432)))
    return found


def dsn_with_dbname(dsn: str, dbname: str) -> str:
    """`dsn` naming database `dbname`; every host and parameter kept (TLS, passfile, …)."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path=f"/{dbname}"))


def with_dead_peer_bounds(url: str) -> str:
    """A libpq (or SQLAlchemy) URL with PG_CLIENT_DEAD_PEER_PARAMS added where it sets none;
    its own parameters are kept as written (a repeated `host`, an encoded path)."""
    parts = urlsplit(url)
    present = {name for name, _ in parse_qsl(parts.query, keep_blank_values=True)}
    missing = {k: v for k, v in PG_CLIENT_DEAD_PEER_PARAMS.items() if k not in present}
    if not missing:
        return url
    query = "&".join(q for q in (parts.query, urlencode(missing)) if q)
    return urlunsplit(parts._replace(query=query))


DAGSTER_PG_SCHEME = "postgresql+psycopg2"


def with_driver(dsn: str, scheme: str) -> str:
    """A libpq URL for a client that parses it itself (SQLAlchemy, yoyo) under `scheme`.

    Those take one host:port in the netloc, but hand the query's parameters to libpq, which
    reads lists there: several hosts move to `?host=a,b&port=1,2`, the form both accept with
    the installed versions (SQLAlchemy's own `?host=a:1&host=b:2` is SQLAlchemy's alone; libpq,
    which `pin serve` checks the URL with, would not read it)."""
    parts = urlsplit(dsn)._replace(scheme=scheme)
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    if "," not in hostlist:
        return urlunsplit(parts)  # one host (a bad port is PgTarget's to report)
    hosts = pg_hosts(dsn)
    query = [
        ("host", ",".join(h for h, _ in hosts)),
        ("port", ",".join(str(p) for _, p in hosts)),
        *parse_qsl(parts.query),
    ]
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}", query=urlencode(query, safe=",")))


def dagster_pg_url_from(pg_dsn: str, dbname: str = "dagster") -> str:
    """Dagster's storage lives in a sibling database `dagster` on the same server(s), reached
    with every parameter of `pg_dsn` (TLS, passfile, target_session_attrs).

    It goes through psycopg2: dagster-postgres' SQL fails under SQLAlchemy with psycopg 3.
    """
    return with_driver(dsn_with_dbname(pg_dsn, dbname), DAGSTER_PG_SCHEME)


def dagster_pg_dsn(storage_url: str) -> str:
    """The libpq URL of Dagster's storage URL, for the project's own connections to it (psycopg
    3): `with_driver`'s query form is libpq's too, so only the scheme changes."""
    return urlunsplit(urlsplit(storage_url)._replace(scheme="postgresql"))
