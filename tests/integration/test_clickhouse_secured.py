"""ClickHouse on a secured estate (CONTRACT section 8): every user of PIN_CLICKHOUSE_URL over
`clickhouses://…?verify=true&ca_certs=…` against a private Debian 18.16 server with TLS
(stack/clickhouse_server.py, `tls_port`), the loader and `pin db migrate` as `writer`, the reads
(`pin devstats labels`, `pin api serve`, `pin reconcile`) as `reader` (`readonly = 2`); passwords
from PIN_CLICKHOUSE_PASSWORD_FILE. Each refusal ends a command in one line naming "ClickHouse at
host:port" and the cause, well within 60 s, and no password is ever printed.

The server is the one of the session's secured estate (tests/support/secured.py), started once
per session and met here as new: no database but `default` and `system`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from pin_pipelines.clickhouse import ClickHouseError, open_clickhouse
from pin_pipelines.config import Settings
from pin_pipelines.devstats.dim import TABLE
from pin_pipelines.devstats.events import COLUMNS, parse_event
from pin_pipelines.devstats.loader import LoadOptions, load_once
from pin_pipelines.kafka import delete_topics, ensure_topics
from pin_pipelines.stack.clickhouse_server import READER, WRITER, LocalClickHouseServer
from pin_pipelines.stack.tls import LocalCA
from tests.support.api import running_api
from tests.support.cli import assert_one_line_error, run_pin, summary
from tests.support.devstats import Group, produce_events
from tests.support.idp import IdentityProvider, api_env

#: The secured estate (tests/support/secured.py) starts once per worker: its four modules run
#: one after another on one worker, so it starts once per run.
pytestmark = pytest.mark.xdist_group("secured")

#: What a refusal may take, end to end (the contract's bound is 60 s).
REFUSAL_SECONDS = 20


@dataclass(frozen=True)
class Secured:
    server: LocalClickHouseServer
    writer: dict[str, str]
    reader: dict[str, str]

    def password(self, user: str) -> str:
        return self.server.password_file(user).read_text().strip()

    def with_password_in_url(self, user: str, password: str, **changes: str) -> dict[str, str]:
        """`user`'s settings with `password` in the URL rather than in a file."""
        url = self.server.user_url(user).replace(f"://{user}@", f"://{user}:{password}@")
        for old, new in changes.items():
            url = url.replace(old, new)
        return {"PIN_CLICKHOUSE_URL": url, "PIN_CLICKHOUSE_PASSWORD_FILE": ""}


@pytest.fixture(scope="module")
def secured(secured_clickhouse: LocalClickHouseServer) -> Secured:
    """An 18.16 server with TLS, its admin on a plaintext loopback port: the session estate's."""
    server = secured_clickhouse
    return Secured(server, server.client_env(WRITER), server.client_env(READER))


@pytest.fixture(scope="module")
def migrated(secured: Secured, pg_dsn: str) -> dict[str, object]:
    """`pin db migrate` as writer over TLS: its JSON summary."""
    return summary(run_pin("db", "migrate", env={"PIN_PG_DSN": pg_dsn, **secured.writer}))


@pytest.fixture(scope="module")
def loaded(
    secured: Secured, migrated: dict[str, object], pg_dsn: str, kafka_bootstrap: str
) -> Group:
    """One group loaded by the loader (`load_once`, what `pin devstats load --once` runs) as
    writer, from a topic of the module's own."""
    suffix = uuid.uuid4().hex[:10]
    options = LoadOptions(
        topic=f"pin.test.secured.{suffix}",
        dlq_topic=f"pin.test.secured.dlq.{suffix}",
        group=f"pin-test-secured-{suffix}",
    )
    ensure_topics(kafka_bootstrap, (options.topic, options.dlq_topic))
    try:
        group = Group()
        produce_events(kafka_bootstrap, options.topic, [group.event(1), group.event(2)])
        settings = Settings.from_env(
            {"PIN_PG_DSN": pg_dsn, "PIN_KAFKA_BOOTSTRAP": kafka_bootstrap, **secured.writer}
        )
        report = load_once(settings, options).as_dict()
        assert (report["consumed"], report["dead_lettered"]) == (2, 0), report
        assert report["inserted"] >= 1, report
    finally:
        delete_topics(kafka_bootstrap, (options.topic, options.dlq_topic))
    return group


def labels_args(group: Group) -> tuple[str, ...]:
    return ("devstats", "labels", "--developer-id", str(group.developer_id), "--ids", str(group.id))


def test_migrate_over_tls_as_writer(secured: Secured, migrated: dict[str, object]) -> None:
    """`pin db migrate` with the writer's clickhouses:// URL and password file applied the
    migration that creates the dimension (18.16: the legacy DDL) on the TLS port."""
    with open_clickhouse(
        secured.writer["PIN_CLICKHOUSE_URL"],
        password_file=Path(secured.writer["PIN_CLICKHOUSE_PASSWORD_FILE"]),
    ) as ch:
        assert ch.rows(f"EXISTS TABLE {TABLE}") == [(1,)]
    assert migrated["clickhouse_applied"] == ["0001_dim_layout_group"]


def test_labels_as_reader(secured: Secured, loaded: Group) -> None:
    """`pin devstats labels` as reader (readonly = 2) reads the group the writer loaded."""
    result = run_pin(*labels_args(loaded), env=secured.reader)
    assert summary(result) == {str(loaded.id): "Студии v2"}


def test_api_serve_as_reader(secured: Secured, loaded: Group, tmp_path: Path) -> None:
    """`pin api serve` as reader: /healthz and a labels request over the reader's TLS pool."""
    with (
        IdentityProvider() as idp,
        running_api({**api_env(idp), **secured.reader}, tmp_path) as api,
    ):
        answer = api.get(
            "/v1/layout-groups/labels", idp.token(loaded.developer_id), params={"ids": loaded.id}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"labels": {str(loaded.id): "Студии v2"}}
    assert secured.password(READER) not in api.stderr()


def test_reconcile_as_reader(secured: Secured, loaded: Group, pg_dsn: str) -> None:
    """`pin reconcile` (a report: it only reads the dimension) as reader over TLS."""
    report = summary(run_pin("reconcile", env={"PIN_PG_DSN": pg_dsn, **secured.reader}))
    assert report["dim_rows_checked"] >= 0


def test_stack_status_reaches_the_tls_server(secured: Secured, tmp_path: Path) -> None:
    """`pin stack status` with the writer's URL answers through TLS (an external server to it)."""
    result = run_pin("stack", "status", env={"PIN_STATE_DIR": str(tmp_path), **secured.writer})
    assert "clickhouse-server: running" in result.stdout + result.stderr, result.stderr
    assert secured.password(WRITER) not in result.stdout + result.stderr


def test_the_reader_is_refused_an_insert(secured: Secured, migrated: dict[str, object]) -> None:
    """readonly = 2 refuses writes: an INSERT into the dimension as reader."""
    row = Group().event(1)
    with (
        open_clickhouse(
            secured.reader["PIN_CLICKHOUSE_URL"],
            password_file=Path(secured.reader["PIN_CLICKHOUSE_PASSWORD_FILE"]),
        ) as ch,
        pytest.raises(ClickHouseError, match="readonly"),
    ):
        ch.insert(TABLE, COLUMNS, [parse_event(json.dumps(row).encode()).row()])


def test_a_rewritten_password_file_counts_from_the_next_connection(
    secured: Secured, tmp_path: Path
) -> None:
    """A rotated secret: the file holds a wrong password (authentication refused), then is
    rewritten with the right one (trailing newline kept, as Kubernetes writes it); the same
    client's next statement, on a new connection, succeeds."""
    rotated = tmp_path / "writer.password"
    rotated.write_text("not-the-password\n")
    with open_clickhouse(secured.writer["PIN_CLICKHOUSE_URL"], password_file=rotated) as ch:
        with pytest.raises(ClickHouseError, match="authentication failed for user 'writer'"):
            ch.rows("SELECT 1")
        rotated.write_text(secured.password(WRITER) + "\n")
        assert ch.rows("SELECT 1") == [(1,)]


@pytest.mark.parametrize(
    ("case", "cause"),
    [
        ("wrong-password", "authentication failed"),
        ("untrusted-certificate", "certificate not trusted"),
        ("plaintext-at-tls-port", "the server requires TLS"),
    ],
)
def test_a_refused_connection_ends_in_one_line_without_the_password(
    secured: Secured, loaded: Group, tmp_path: Path, case: str, cause: str
) -> None:
    """`pin devstats labels` with a wrong password in the URL, with ca_certs of another CA, and
    with a plaintext clickhouse:// URL at the TLS port: non-zero exit within the bound, one line
    naming the server and the cause, the URL's password nowhere in stdout or stderr."""
    password = secured.password(READER)
    if case == "wrong-password":
        password = "Wr0ng-" + password
        env = secured.with_password_in_url(READER, password)
    elif case == "untrusted-certificate":
        other = LocalCA(tmp_path / "other-ca").ensure()
        env = secured.with_password_in_url(
            READER, password, **{str(secured.server.ca.cert): str(other.cert)}
        )
    else:
        env = secured.with_password_in_url(READER, password, **{"clickhouses://": "clickhouse://"})
        env["PIN_CLICKHOUSE_URL"] = env["PIN_CLICKHOUSE_URL"].split("?")[0]
    started = time.monotonic()
    result = run_pin(*labels_args(loaded), env=env, timeout=60)
    assert time.monotonic() - started < REFUSAL_SECONDS
    assert_one_line_error(result, f"ClickHouse at 127.0.0.1:{secured.server.tls_port}", cause)
    assert password not in result.stdout + result.stderr


def test_up_and_status_of_the_secured_server_are_idempotent(secured: Secured) -> None:
    """A second `up` finds it running (same passwords, config untouched); status shows both
    ports; the password files are readable by their owner only."""
    passwords = {user: secured.password(user) for user in (WRITER, READER)}
    assert secured.server.up()["state"] == "already running"
    status = secured.server.status()
    assert (status["state"], status["tls_port"]) == ("running", secured.server.tls_port)
    for user, password in passwords.items():
        assert secured.password(user) == password
        assert secured.server.password_file(user).stat().st_mode & 0o777 == 0o600
