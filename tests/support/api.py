"""`pin api serve` as a real process for the read API's end-to-end tests and its bench: started
with a free port (and a free one for its /metrics listener), waited for on /healthz, asked over
HTTP, stopped by a signal. Its stderr (the
JSON request log) goes to a file, never a pipe that could fill up and block it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from starlette.exceptions import StarletteDeprecationWarning

from pin_pipelines.api.app import create_app
from pin_pipelines.api.auth import TokenVerifier
from pin_pipelines.api.jwks import JwksCache
from pin_pipelines.api.observe import ApiMetrics
from pin_pipelines.api.pool import ClickHousePool
from pin_pipelines.stack.process import free_port
from tests.support.cli import PIN
from tests.support.idp import AUDIENCE, ISSUER, IdentityProvider

with warnings.catch_warnings():  # starlette 1.x would rather have the httpx2 fork; httpx works
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient


class ApiProcess:
    def __init__(self, env: dict[str, str], logs: Path, *, deaf: bool = False) -> None:
        """`deaf`: started with SIGTERM and SIGINT ignored, as a supervisor may leave them."""
        self.port = free_port()
        self.metrics_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.err = logs / f"api-{self.port}.err"
        with self.err.open("w") as err:
            self.process = subprocess.Popen(
                [PIN, "api", "serve"],
                env={
                    **os.environ,
                    **env,
                    "PIN_API_PORT": str(self.port),
                    "PIN_API_METRICS_PORT": str(self.metrics_port),
                },
                stdout=subprocess.DEVNULL,
                stderr=err,
                preexec_fn=_ignore_stop_signals if deaf else None,
            )
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def wait_until_healthy(self, timeout: float = 90) -> None:
        """Until /healthz answers 200 (on chdb the API may wait for the folder's owner)."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"pin api serve exited: {self.stderr()[-3000:]}"
            try:
                if self.http.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"no /healthz within {timeout:g}s"
            time.sleep(0.05)

    def get(self, path: str, token: str | None = None, **kwargs: Any) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return self.http.get(path, headers=headers, **kwargs)

    def scrape(self) -> httpx.Response:
        """The metrics listener's /metrics (PIN_API_METRICS_PORT, no token)."""
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Send `signum`; the exit status once it has exited."""
        self.http.close()
        self.process.send_signal(signum)
        return self.process.wait(timeout)

    def kill(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)

    def stderr(self) -> str:
        return self.err.read_text()

    def log_events(self, event: str) -> list[dict[str, Any]]:
        """The JSON log lines of one event, in order."""
        lines = (json.loads(line) for line in self.stderr().splitlines() if line.startswith("{"))
        return [line for line in lines if line.get("event") == event]


def _ignore_stop_signals() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


@contextmanager
def running_api(env: dict[str, str], logs: Path, *, deaf: bool = False) -> Iterator[ApiProcess]:
    """A healthy `pin api serve`; killed (and waited for) at the end whatever happened."""
    api = ApiProcess(env, logs, deaf=deaf)
    try:
        api.wait_until_healthy()
        yield api
    finally:
        api.kill()


@contextmanager
def api_client(
    clickhouse_url: str, idp: IdentityProvider, metrics: ApiMetrics | None = None
) -> Iterator[TestClient]:
    """The real read API app (`create_app`) over `clickhouse_url`, served in this process through
    FastAPI's TestClient, trusting `idp`'s tokens (its JWKS fetched over HTTP)."""
    verifier = TokenVerifier(JwksCache(idp.jwks_url), issuer=ISSUER, audience=AUDIENCE)
    verifier.keys.load()
    app = create_app(pool := ClickHousePool(clickhouse_url), verifier, metrics or ApiMetrics())
    with pool, TestClient(app, raise_server_exceptions=False) as client:
        yield client
