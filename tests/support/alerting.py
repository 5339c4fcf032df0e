"""The paging path on loopback: Debian's Prometheus and Alertmanager, run with the
shipped configs (ops/prometheus/prometheus.yml, ops/alertmanager/alertmanager.yml) pointed at
this test's exporter, rules and webhook receiver, with intervals of a second instead of 15 s.

The receiver records every notification Alertmanager posts, with the time it arrived, so a test
asserts what on-call would see: which alert, firing or resolved, its labels and runbook link,
at which receiver (the route), and when.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from pin_pipelines.config import SOURCE_ROOT
from pin_pipelines.stack.process import free_port, stop_child, wait_until
from tests.support.http import answers_http

PROMETHEUS_CONFIG = SOURCE_ROOT / "ops" / "prometheus" / "prometheus.yml"
ALERTMANAGER_CONFIG = SOURCE_ROOT / "ops" / "alertmanager" / "alertmanager.yml"
#: Scrape, rule evaluation and Alertmanager grouping intervals of the test (production: 15 s+).
INTERVAL = "1s"


@dataclass(frozen=True)
class Notice:
    """One alert of one notification: `receiver` is the webhook path the route chose."""

    arrived: float  # time.time()
    receiver: str
    status: str  # firing | resolved
    labels: dict[str, str]
    annotations: dict[str, str]


@dataclass
class Receiver:
    """A webhook receiver (Alertmanager's webhook_configs) on a loopback port."""

    port: int
    notices: list[Notice] = field(default_factory=list)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    def record(self, path: str, body: dict[str, Any]) -> None:
        now = time.time()
        with self._changed:
            for alert in body.get("alerts", []):
                self.notices.append(
                    Notice(now, path, alert["status"], alert["labels"], alert["annotations"])
                )
            self._changed.notify_all()

    def wait_for(self, alertname: str, status: str, *, after: float, timeout: float) -> Notice:
        """The first notice of `alertname` in `status` that arrived after `after` (time.time())."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for notice in self.notices:
                    if (
                        notice.labels.get("alertname") == alertname
                        and notice.status == status
                        and notice.arrived > after
                    ):
                        return notice
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = sorted(
                        {(n.labels.get("alertname", "?"), n.status) for n in self.notices}
                    )
                    raise AssertionError(
                        f"no {status} {alertname} at the receiver within {timeout:.0f}s;"
                        f" seen: {seen}"
                    )
                self._changed.wait(left)

    def received(self, alertname: str, *, after: float) -> list[Notice]:
        with self._changed:
            return [
                n
                for n in self.notices
                if n.labels.get("alertname") == alertname and n.arrived > after
            ]


@contextmanager
def webhook_receiver() -> Iterator[Receiver]:
    receiver = Receiver(port=0)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            receiver.record(self.path, json.loads(self.rfile.read(length) or b"{}"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()


def _binary(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed (bin/test installs Debian's prometheus packages)"
    return path


@contextmanager
def _server(name: str, config: dict[str, Any], workdir: Path, *flags: str) -> Iterator[int]:
    """`name` (a Debian binary) with `config` as its --config.file, its data under `workdir`,
    listening on a free loopback port (yielded) until the block ends: SIGTERM, then SIGKILL
    after 10 s. Ready once its /-/ready answers 200."""
    path = workdir / f"{name}.yml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    args = [
        _binary(name),
        f"--config.file={path}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
        *flags,
    ]
    log = workdir / f"{name}.log"
    with log.open("w") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(
            lambda: _ready(process, f"http://127.0.0.1:{port}/-/ready", log),
            timeout=30,
            what=f"{name} ready",
        )
        yield port
    finally:
        stop_child(process, grace_seconds=10)


def _ready(process: subprocess.Popen[bytes], url: str, log: Path) -> bool:
    assert process.poll() is None, f"{process.args[0]} exited: {log.read_text()[-2000:]}"
    return answers_http(url)


@contextmanager
def alertmanager(receiver: Receiver, workdir: Path) -> Iterator[int]:
    """The shipped route and receivers, each webhook URL moved to `receiver` (same path)."""
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    for entry in config["receivers"]:
        for hook in entry.get("webhook_configs", []):
            path = urllib.parse.urlsplit(hook["url"]).path
            hook["url"] = f"http://127.0.0.1:{receiver.port}{path}"
    for route in [config["route"], *config["route"].get("routes", [])]:
        route.update(group_wait="0s", group_interval=INTERVAL)
    with _server(
        "prometheus-alertmanager",
        config,
        workdir,
        f"--storage.path={workdir / 'alertmanager-data'}",
        "--cluster.listen-address=",  # one node: no gossip port
    ) as port:
        yield port


@contextmanager
def prometheus(
    rules: str, exporter_port: int, alertmanager_port: int, workdir: Path
) -> Iterator[int]:
    """The shipped config: `rules` as its rule file, its pin-pipelines job scraping the exporter
    at `exporter_port`, alerts to `alertmanager_port`; the read API's job is left out (no API
    runs here)."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"] = {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL}
    (workdir / "alerts.yml").write_text(rules)
    config["rule_files"] = [str(workdir / "alerts.yml")]
    config["alerting"]["alertmanagers"][0]["static_configs"] = [
        {"targets": [f"127.0.0.1:{alertmanager_port}"]}
    ]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    exporter = jobs["pin-pipelines"]
    exporter["static_configs"] = [{"targets": [f"127.0.0.1:{exporter_port}"]}]
    exporter["scrape_timeout"] = INTERVAL
    config["scrape_configs"] = [exporter]
    with _server(
        "prometheus",
        config,
        workdir,
        f"--storage.tsdb.path={workdir / 'prometheus-data'}",
        "--rules.alert.resend-delay=1s",
    ) as port:
        yield port


def query(prometheus_port: int, expr: str) -> list[dict[str, Any]]:
    """An instant query's result vector."""
    url = f"http://127.0.0.1:{prometheus_port}/api/v1/query?" + urllib.parse.urlencode(
        {"query": expr}
    )
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return list(body["data"]["result"])
