"""`pin api serve` as a real process: it answers while the continuous loader (`pin
devstats load`, a real process aimed at the test's topic) runs, on both engines — the embedded
chdb folder, read through the loader that owns it, and the Debian ClickHouse server — stops with
exit 0 on SIGTERM and on SIGINT (also when started with both ignored), and fails in one line on
bad settings and unreachable things.

Tokens come from a real identity provider on 127.0.0.1 (tests/support/idp.py). Every process a
test starts is killed and waited for in a `finally` (tests/support/api.py, the loaders'
context manager).
"""

from __future__ import annotations

import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pin_pipelines.api.server import MAX_REQUEST_HEAD_BYTES
from pin_pipelines.devstats.loader import LoadOptions
from pin_pipelines.stack.process import free_port
from tests.support.api import ApiProcess, running_api
from tests.support.cli import assert_one_line_error, run_pin
from tests.support.devstats import Group, produce_events
from tests.support.idp import IdentityProvider, api_env
from tests.support.loaders import loader_env, loaders, wait_for  # the loader as a real process

LABELS = "/v1/layout-groups/labels"
GROUPS = "/v1/layout-groups"


@pytest.fixture(scope="module")
def idp() -> Iterator[IdentityProvider]:
    with IdentityProvider() as provider:
        yield provider


def head_too_long(api: ApiProcess) -> tuple[int, bytes]:
    """A request line one byte longer than the server's bound on a request's head, its end not
    sent: its status and body, from a raw socket (HTTP clients refuse such URLs). Exactly one
    byte over, so the server has read everything when it refuses, and closes without a reset."""
    line = f"GET {LABELS}?ids=".encode()
    with socket.create_connection(("127.0.0.1", api.port), timeout=10) as conn:
        conn.sendall(line + b"a" * (MAX_REQUEST_HEAD_BYTES + 1 - len(line)))
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def folder_holder(chdb_url: str) -> int:
    """The process that has the embedded folder open (chdb writes its PID in `status`)."""
    status = (Path(chdb_url.removeprefix("chdb://")) / "status").read_text()
    return int(status.split("PID:")[1].split()[0])


def check_the_surface(api: ApiProcess, idp: IdentityProvider, group: Group) -> None:
    """The contract's answers through the process: labels, groups, 401 with its header, 403,
    400, a head too long (JSON too), /openapi.json without a token; /metrics without a token on
    the metrics listener's port, a 401 without one on the API's (a 404 with one)."""
    token = idp.token(group.developer_id)
    missing = uuid.uuid4()
    labels = api.get(LABELS, token, params={"ids": f"{group.id},{missing}"})
    assert labels.json() == {"labels": {str(group.id): "Студии v1", str(missing): str(missing)}}
    groups = api.get(
        GROUPS,
        idp.token(group.developer_id, kid="ec-1"),
        params={"projectId": str(group.project_id)},
    )
    assert [g["id"] for g in groups.json()["groups"]] == [str(group.id)]
    unauthorized = api.get(LABELS, params={"ids": str(group.id)})
    assert unauthorized.status_code == 401 and unauthorized.headers["www-authenticate"] == "Bearer"
    assert (
        api.get(
            LABELS, idp.token(group.developer_id, roles=[]), params={"ids": str(group.id)}
        ).status_code
        == 403
    )
    bad = api.get(LABELS, token, params={"ids": "'; DROP TABLE x; --"})
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    huge = api.get(LABELS, token, params={"ids": "a" * 60_000})
    assert huge.status_code == 400 and "longer than" in huge.json()["error"]
    status, body = head_too_long(api)
    assert status == 400 and body.startswith(b'{"error": "invalid HTTP request')
    assert api.get("/openapi.json").json()["paths"].keys() >= {LABELS, GROUPS}
    on_the_api = api.get("/metrics")
    assert on_the_api.status_code == 401 and on_the_api.headers["www-authenticate"] == "Bearer"
    assert api.get("/metrics", token).status_code == 404
    scraped = api.scrape()
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    assert 'devstats_api_requests_total{status="200"}' in scraped.text
    assert 'devstats_api_requests_total{status="401"}' in scraped.text
    assert 'devstats_api_requests_total{status="404"}' in scraped.text
    assert "process_cpu_seconds_total" in scraped.text


@pytest.mark.parametrize(
    ("engine", "stop_signal", "deaf"),
    [
        pytest.param("embedded", signal.SIGTERM, False, id="embedded-sigterm"),
        pytest.param("server", signal.SIGINT, True, id="server-sigint-started-deaf"),
    ],
)
def test_the_api_answers_while_a_continuous_loader_runs(
    request: pytest.FixtureRequest,
    engine: str,
    stop_signal: int,
    deaf: bool,
    idp: IdentityProvider,
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    """Tried: a loader process starts and loads a first group; `pin api serve` starts beside it
    (on chdb it reads through the loader, the folder's owner) and answers the contract's
    requests. Then, for 3 s, events (new groups, new versions) go into the topic while a client
    asks for labels without pause: every answer is 200, and each name shows up within seconds.
    On chdb the loader stops first: the API takes the folder over and keeps answering. The API
    exits 0 on its stop signal (SIGINT on the server, where it was started with SIGTERM and
    SIGINT ignored), the loader on SIGTERM with everything loaded."""
    url = str(
        request.getfixturevalue(
            "chdb_folder_url" if engine == "embedded" else "clickhouse_server_url"
        )
    )
    env = loader_env(url, kafka_bootstrap, pg_dsn, tmp_path)
    developer = uuid.uuid4()
    first = Group(developer_id=developer)
    with loaders(loader_options, env, tmp_path) as start:
        loader = start("loader")
        produce_events(kafka_bootstrap, loader_options.topic, [first.event(1)])
        with running_api({**env, **api_env(idp)}, tmp_path, deaf=deaf) as api:
            token = idp.token(developer)

            def label(group: Group) -> str:
                answer = api.get(LABELS, token, params={"ids": str(group.id)})
                assert answer.status_code == 200, answer.text
                return str(answer.json()["labels"][str(group.id)])

            wait_for("the first group labelled", lambda: label(first) == "Студии v1", 60)
            check_the_surface(api, idp, first)

            groups = [Group(developer_id=developer) for _ in range(6)]
            statuses: list[int] = []
            done = threading.Event()

            def ask_without_pause() -> None:
                asked = ",".join(str(g.id) for g in [first, *groups])
                while not done.is_set():
                    statuses.append(api.get(LABELS, token, params={"ids": asked}).status_code)

            asking = threading.Thread(target=ask_without_pause)
            asking.start()
            try:
                deadline = time.monotonic() + 3
                for n, group in enumerate(groups):
                    produce_events(
                        kafka_bootstrap, loader_options.topic, [group.event(1), first.event(2 + n)]
                    )
                    time.sleep(max(0.0, (deadline - time.monotonic()) / (len(groups) - n)))
                for group in groups:
                    wait_for("a new group labelled", lambda g=group: label(g) == "Студии v1", 20)
                wait_for(
                    "the first group renamed",
                    lambda: label(first) == f"Студии v{len(groups) + 1}",
                    20,
                )
            finally:
                done.set()
                asking.join(30)
            assert len(statuses) > 20 and set(statuses) == {200}, statuses[:50]

            if engine == "embedded":
                assert folder_holder(url) == loader.process.pid  # the API read through it
                report, _ = loader.stop()
                _assert_loaded_every_event(report, groups)
                assert label(groups[-1]) == "Студии v1"
                assert folder_holder(url) == api.process.pid  # the API took the folder over
                assert api.get("/healthz").status_code == 200

            assert api.stop(stop_signal) == 0, api.stderr()[-2000:]
            assert api.log_events("api_stopped")
            (serving,) = api.log_events("api_serving")
            assert (serving["url"], serving["metrics_url"]) == (
                api.url,
                f"http://127.0.0.1:{api.metrics_port}/metrics",
            )
            server_lines = [line["message"] for line in api.log_events("api_server_log")]
            assert server_lines == ["Invalid HTTP request received."]  # the head too long
            requests = api.log_events("api_request")
            assert {
                r["developer_id"] for r in requests if r["status"] == 200 and r["route"] == "labels"
            } == {str(developer)}
        if engine == "server":
            report, _ = loader.stop()
            _assert_loaded_every_event(report, groups)


def _assert_loaded_every_event(report: dict[str, Any], groups: list[Group]) -> None:
    """Every event consumed and stored or skipped: two versions of the first group that arrive
    in one batch store only the newer (skipped_stale), which a loaded machine makes likely."""
    assert report["consumed"] == 1 + 2 * len(groups), report
    assert report["inserted"] + report["skipped_stale"] == report["consumed"], report
    assert report["inserted"] >= 1 + len(groups) + 1, report  # each new group, the last rename


def test_a_loader_started_after_the_api_loads_through_it(
    chdb_folder_url: str,
    idp: IdentityProvider,
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    """The embedded folder with no loader: `pin api serve` opens it as its owner. A continuous
    loader started then does not wait for the folder (it would for a process that opened it
    without serving): it sends its statements, inserts included, to the API, whose answers show
    the groups within seconds; both stop with exit 0."""
    env = loader_env(chdb_folder_url, kafka_bootstrap, pg_dsn, tmp_path)
    group = Group()
    with running_api({**env, **api_env(idp)}, tmp_path) as api:
        assert folder_holder(chdb_folder_url) == api.process.pid
        token = idp.token(group.developer_id)
        with loaders(loader_options, env, tmp_path) as start:
            loader = start("loader")
            produce_events(kafka_bootstrap, loader_options.topic, [group.event(1)])

            def labelled() -> bool:
                answer = api.get(LABELS, token, params={"ids": str(group.id)})
                return bool(answer.json()["labels"][str(group.id)] == "Студии v1")

            assert wait_for("the group labelled", labelled, 60) < 30
            report, _ = loader.stop()
            assert report["inserted"] == 1
        assert folder_holder(chdb_folder_url) == api.process.pid
        assert api.stop() == 0, api.stderr()[-2000:]


# --- one line for what cannot work ----------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        pytest.param("no-jwks-url", "PIN_API_JWKS_URL is not set", id="no-jwks-url"),
        pytest.param("no-issuer", "PIN_API_ISSUER is not set", id="no-issuer"),
        pytest.param("ftp-jwks-url", "must be an http:// or https:// URL", id="jwks-not-http"),
        pytest.param("jwks-down", "cannot fetch the JWKS", id="jwks-unreachable"),
        pytest.param(
            "clickhouse-down", "the dimension cannot be read", id="clickhouse-unreachable"
        ),
        pytest.param(
            "clickhouse-wrong-password",
            "authentication failed for user 'default'",
            id="clickhouse-wrong-password",
        ),
        pytest.param("port-in-use", "cannot listen on 127.0.0.1", id="port-in-use"),
        pytest.param("bad-port", "PIN_API_PORT must be a port number", id="bad-port"),
    ],
)
def test_bad_settings_and_unreachable_services_fail_in_one_line(
    idp: IdentityProvider, clickhouse_server_url: str, case: str, needle: str
) -> None:
    env = {
        **api_env(idp),
        "PIN_CLICKHOUSE_URL": clickhouse_server_url,
        "PIN_API_PORT": str(free_port()),
        "PIN_API_METRICS_PORT": str(free_port()),
    }
    with socket.socket() as taken:
        if case == "no-jwks-url":
            env["PIN_API_JWKS_URL"] = ""
        elif case == "no-issuer":
            env["PIN_API_ISSUER"] = ""
        elif case == "ftp-jwks-url":
            env["PIN_API_JWKS_URL"] = "ftp://127.0.0.1/jwks.json"
        elif case == "jwks-down":
            env["PIN_API_JWKS_URL"] = f"http://127.0.0.1:{free_port()}/jwks.json"
        elif case == "clickhouse-down":
            env["PIN_CLICKHOUSE_URL"] = (
                f"clickhouse://default@127.0.0.1:{free_port()}/pin_dev_stats"
            )
        elif case == "clickhouse-wrong-password":
            scheme, host = clickhouse_server_url.split("://default@", 1)
            env["PIN_CLICKHOUSE_URL"] = f"{scheme}://default:not-the-password@{host}"
        elif case == "port-in-use":
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            env["PIN_API_PORT"] = str(taken.getsockname()[1])
        elif case == "bad-port":
            env["PIN_API_PORT"] = "http"
        result = run_pin("api", "serve", env=env, timeout=60)
    assert_one_line_error(result, needle)
