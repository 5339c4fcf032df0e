"""A ClickHouse server over the native protocol (clickhouse-driver).

dagster-clickhouse's `ClickhouseResource` is a Dagster resource around the same `Client`; this core
stays free of Dagster, so it uses the driver directly.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from clickhouse_driver import Client
from clickhouse_driver.errors import Error as DriverError
from clickhouse_driver.errors import NetworkError, ServerException, SocketTimeoutError

from pin_pipelines.clickhouse.client import ClickHouse, ClickHouseError, ClickHouseUnavailable, Row
from pin_pipelines.clickhouse.literals import Param, UuidSet, render
from pin_pipelines.clickhouse.url import ServerAddress
from pin_pipelines.config import TCP_KEEPALIVE

#: The driver logs every refused connection with a traceback; callers get a PinError instead.
logging.getLogger("clickhouse_driver.connection").setLevel(logging.ERROR)

_UNREACHABLE = (NetworkError, SocketTimeoutError, EOFError, OSError)

#: Server errors that say a part of a cluster is down or busy, not that the statement is wrong:
#: a Distributed query found no live replica of a shard (279) or lost one mid-way (32, 209, 210),
#: ZooKeeper is away so replicated tables are read-only (225, 242, 999) or its state changed
#: under the statement (244: an insert that raced a migration's ALTER on 18.16, "Bad version" on
#: the table's columns node; a CI run's loader ended on it), an insert's fate is unknown (319),
#: a DDL waited out the hosts that are down (159), or the server is overloaded (202, 252). The
#: same statement may succeed later: ClickHouseUnavailable, which callers retry.
_TRANSIENT_SERVER_CODES = frozenset({32, 159, 202, 209, 210, 225, 242, 244, 252, 279, 319, 999})

#: The settings sent with every statement. Both only act on Distributed tables (a cluster,
#: clickhouse/cluster.py) and change nothing on a single server:
#: - insert_distributed_sync: an INSERT returns once each shard has stored its rows (not when
#:   they are queued on the entry server), so an acknowledged insert is a stored one;
#: - load_balancing in_order: each shard's reads and writes go to its first live replica in
#:   remote_servers (its local one first, prefer_localhost_replica), so the loader's version
#:   guard reads the replica its last insert went to rather than one that may not have fetched
#:   it yet; a replica that is down is skipped.
CLUSTER_SETTINGS = {"insert_distributed_sync": 1, "load_balancing": "in_order"}

#: A live server answers a long statement late; a silent one (a partition) is found by
#: keepalive well before this receive timeout.
SEND_RECEIVE_SECONDS = 60
#: How long the native protocol's hello may take. A server answers it at once, so only a peer
#: that is not the server the URL says waits it out (a TLS port that stays silent before a
#: plaintext client, a proxy), and the command fails well within the contract's 60 s; the TLS
#: handshake itself is bounded by the connect timeout.
HANDSHAKE_SECONDS = 10


class ServerClickHouse(ClickHouse):
    #: An insert through a Distributed table is acknowledged once every shard it touched has
    #: written its part and registered it in ZooKeeper (insert_distributed_sync): a wait after
    #: each batch that a second connection fills with the next batch's guard and insert
    #: (measured on the local cluster, 50,000 events: 0.89-1.08 s instead of 1.03-1.32 s; a
    #: third connection gained nothing).
    inserts_in_flight = 2

    def __init__(self, address: ServerAddress, *, connect_timeout: float = 3.0) -> None:
        self.location = str(address)
        self._connect_timeout = connect_timeout
        self._address = address
        # Connects lazily on the first statement; the driver reconnects after a network error.
        # The password is set before each statement (_driver_errors): it may come from a file.
        self._client = Client(
            host=address.host,
            port=address.port,
            user=address.user,
            secure=address.secure,
            verify=address.verify,
            ca_certs=address.ca_certs,
            certfile=address.certfile,
            keyfile=address.keyfile,
            connect_timeout=connect_timeout,
            send_receive_timeout=SEND_RECEIVE_SECONDS,
            tcp_keepalive=TCP_KEEPALIVE,
            sync_request_timeout=5,
            settings=CLUSTER_SETTINGS,
        )
        self._dedup_supported: bool | None = None
        #: An insert was sent and its end of stream not read yet (see send_insert).
        self._unconfirmed = False

    def command(self, sql: str, params: Mapping[str, Param] | None = None) -> None:
        self._execute(render(sql, params))

    def rows(self, sql: str, params: Mapping[str, Param] | None = None) -> list[Row]:
        """A UuidSet parameter travels as an external table named after it (`IN _name`): binary
        UUIDs, a third of the time of the same query with the ids in a string (measured on
        18.16 with 1000 ids: 4 ms vs 12 ms)."""
        return [tuple(row) for row in self._execute(*self._with_sets(sql, params))]

    def records(self, sql: str, params: Mapping[str, Param] | None = None) -> list[dict[str, Any]]:
        rows, columns = self._execute(*self._with_sets(sql, params), with_column_types=True)
        names = [name for name, _ in columns]
        return [dict(zip(names, row, strict=True)) for row in rows]

    @staticmethod
    def _with_sets(
        sql: str, params: Mapping[str, Param] | None
    ) -> tuple[str, list[dict[str, Any]] | None]:
        """The statement, and its UuidSet parameters as external tables (see `rows`)."""
        plain = {k: v for k, v in (params or {}).items() if not isinstance(v, UuidSet)}
        sets = {k: v for k, v in (params or {}).items() if isinstance(v, UuidSet)}
        tables = [
            {
                "name": f"_{name}",
                "structure": [("id", "UUID")],
                "data": [{"id": i} for i in uuids.ids],
            }
            for name, uuids in sets.items()
        ]
        return render(sql, plain, verbatim={name: f"_{name}" for name in sets}), tables or None

    def send_insert(
        self,
        table: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        dedup_token: str | None = None,
    ) -> None:
        """The driver's `execute` of an INSERT (`Client.process_insert_query`), minus waiting
        for the server's end of stream: 18.16 takes 3–10 ms to write a 1,000-row part, about
        what the client spends serialising it, and the loader decodes its next batch meanwhile.
        The protocol carries one statement at a time, so every other statement confirms this
        insert first."""
        if not rows:
            return
        self.confirm_insert()
        settings = {}
        if dedup_token is not None and self.deduplicates_inserts:
            settings["insert_deduplication_token"] = dedup_token
        sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES"
        client = self._client
        with self._driver_errors(), client.disconnect_on_error(sql, settings):
            client.connection.send_query(sql)
            client.connection.send_external_tables(None)
            sample = client.receive_sample_block()
            if sample:  # as the driver does: no sample block, no data and no end to wait for
                client.send_data(sample, rows)
        self._unconfirmed = bool(sample)

    def confirm_insert(self) -> None:
        if not self._unconfirmed:
            return
        self._unconfirmed = False
        with self._driver_errors():
            try:
                self._client.receive_end_of_insert_query()
            except BaseException:
                self._client.disconnect()  # what execute() does on any error mid-statement
                raise

    def sibling(self, host: str, port: int) -> ServerClickHouse:
        return ServerClickHouse(
            dataclasses.replace(self._address, host=host, port=port),
            connect_timeout=self._connect_timeout,
        )

    def close(self) -> None:
        self._client.disconnect()

    @property
    def deduplicates_inserts(self) -> bool:
        """`insert_deduplication_token` exists since ClickHouse 22.2; 18.16 does not know it (the
        driver would drop it with a warning), so it is skipped there. A retried insert then relies
        on ReplacingMergeTree alone: an identical row merges away and argMax reads are
        unaffected."""
        if self._dedup_supported is None:
            found = self.rows(
                "SELECT count() FROM system.settings WHERE name = 'insert_deduplication_token'"
            )
            self._dedup_supported = found[0][0] > 0
        return self._dedup_supported

    def _execute(
        self,
        sql: str,
        external_tables: list[dict[str, Any]] | None = None,
        *,
        with_column_types: bool = False,
    ) -> Any:
        self.confirm_insert()
        with self._driver_errors():
            return self._client.execute(
                sql, external_tables=external_tables, with_column_types=with_column_types
            )

    def _handshake(self) -> None:
        """Connect with the hello bounded by HANDSHAKE_SECONDS, then give the socket the
        statements' receive timeout."""
        connection = self._client.connection
        connection.send_receive_timeout = HANDSHAKE_SECONDS
        try:
            connection.connect()
        finally:
            connection.send_receive_timeout = SEND_RECEIVE_SECONDS
        connection.socket.settimeout(SEND_RECEIVE_SECONDS)

    @contextmanager
    def _driver_errors(self) -> Iterator[None]:
        """The driver's errors as PinErrors naming the server: retryable (ClickHouseUnavailable)
        or not (ClickHouseError: a refused password or certificate does not heal by itself).

        Also gives the connection the current password first: read from
        PIN_CLICKHOUSE_PASSWORD_FILE at each statement (a file read is microseconds), so
        whichever statement (re)connects uses a rotated secret."""
        self._client.connection.password = self._address.current_password()
        connecting = not self._client.connection.connected
        try:
            if connecting:
                self._handshake()
            yield
        except _UNREACHABLE as exc:
            self._client.disconnect()
            refused = _refused_by_tls(exc, self._address)
            if refused is not None:
                raise ClickHouseError(f"ClickHouse at {self.location}: {refused}") from exc
            if connecting and not self._address.secure and _cut_before_hello(exc):
                raise ClickHouseUnavailable(
                    f"ClickHouse at {self.location}: the server requires TLS? It cut the "
                    f"connection before its hello ({_first_line(exc)}); use clickhouses:// (or "
                    "secure=true) for its TLS port"
                ) from exc
            raise ClickHouseUnavailable(
                f"ClickHouse server at {self.location} is unreachable: {_first_line(exc)}"
            ) from exc
        except ServerException as exc:
            if exc.code in _AUTHENTICATION_CODES:
                raise ClickHouseError(
                    f"ClickHouse at {self.location}: authentication failed for user "
                    f"{self._address.user!r} ({_first_line(exc)}); check the URL's password or "
                    "PIN_CLICKHOUSE_PASSWORD_FILE"
                ) from exc
            error = (
                ClickHouseUnavailable if exc.code in _TRANSIENT_SERVER_CODES else ClickHouseError
            )
            raise error(f"ClickHouse server at {self.location}: {_first_line(exc)}") from exc
        except DriverError as exc:
            raise ClickHouseError(
                f"ClickHouse server at {self.location}: {_first_line(exc)}"
            ) from exc


#: UNKNOWN_USER, WRONG_PASSWORD, REQUIRED_PASSWORD, IP_ADDRESS_NOT_ALLOWED (18.16) and
#: AUTHENTICATION_FAILED (current servers, which no longer tell a wrong user from a wrong password).
_AUTHENTICATION_CODES = frozenset({192, 193, 194, 195, 516})


def _refused_by_tls(exc: BaseException, address: ServerAddress) -> str | None:
    """Why the TLS layer refused a connection, in an operator's words and with the fix; None
    when it did not. Not retried: a certificate does not become trusted by itself."""
    text = _first_line(exc)
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (
            f"certificate not trusted ({text}); ca_certs= must name the CA that signed the "
            "server's certificate"
        )
    if address.secure and "WRONG_VERSION_NUMBER" in text.upper():
        return f"the server does not speak TLS on this port ({text}); use clickhouse://"
    return None


def _cut_before_hello(exc: BaseException) -> bool:
    """A connection reset or closed while connecting, before the server's hello: what a
    plaintext client at a TLS port meets, since the server reads its cleartext hello as a
    broken TLS handshake (18.16 resets, others close). A server that is down refuses the
    connection instead, and a partition times out, so this is named as the likely cause; still
    retried (ClickHouseUnavailable), since a server dying mid-handshake looks the same."""
    return isinstance(exc, EOFError) or "Connection reset by peer" in str(exc)


_REPLICA_FAILURE = re.compile(r"e\.displayText\(\) = [\w:]+: (.*?), e\.what\(\)")


def _first_line(exc: BaseException) -> str:
    """The driver's message without the server's stack trace, on one line. A shard without a
    reachable replica (279) lists each replica's failure three times: once each is enough."""
    text = " ".join(str(exc).split("Stack trace:")[0].split()) or type(exc).__name__
    failures = dict.fromkeys(_REPLICA_FAILURE.findall(text))
    if isinstance(exc, ServerException) and exc.code == 279 and failures:
        text = f"Code: 279. All connection tries failed: {'; '.join(failures)}"
    return text
