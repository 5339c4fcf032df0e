"""The dev-stats read API under load; not a test. Prints ONE JSON line.

For each engine, one developer's G groups are stored (the loader's own write) and a real
`pin api serve` process is started on them, trusting a tiny identity provider of this run
(tests/support/idp.py: a JWKS on 127.0.0.1, an RS256 token). Then, in alternating phases
(direct, api, direct, api, …, P phases of S seconds each), this process issues R requests/s of
`labels` for I ids (90 % of them stored groups, the rest missing), open-loop: each call has a
scheduled start every 1/R s, W worker threads take them in order, and a call's latency runs
from its scheduled start, so a call that had to wait for a busy worker counts its wait (no
coordinated omission).

- direct: `devstats.reads.labels` in this process, through a pool of clients of the same
  PIN_CLICKHOUSE_URL as the API's (api/pool.py: 4 server connections; on chdb the one client,
  which reaches the folder through its owner, the API process);
- api: `GET /v1/layout-groups/labels?ids=…` with the bearer token, one keep-alive HTTP/1.1
  connection per worker (a minimal client, `KeepAlive`, so that this process's CPU goes to
  the read, not to an HTTP library): token verification, parameter parsing, the same read,
  JSON, the request log line and the metrics included.

Reported per engine: p50/p99/mean of each (all phases pooled), their ratios api/direct (goal:
p99 < 50 ms, overhead ≤ 2× the direct read), the same requests as the API's log timed them
(`api_inside`: arrival to the answer's start, without the client's side and the sockets), the
API's CPU per request, and the load average before and after (the machine is shared).

Usage: .venv/bin/python bench/bench_api.py [--engines server,embedded] [--rate 200]
       [--ids 100] [--groups 1000] [--seconds 15] [--phases 4] [--workers 16]
Uses PIN_BENCH_CLICKHOUSE_SERVER_URL (default the stack's server, 127.0.0.1:9000, migrated
here); the embedded engine is a temporary folder of this run. PIN_PG_DSN is not used.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# tests.support: the identity provider and the API process, shared with the API's tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import quantiles

from pin_pipelines.api.pool import ClickHousePool
from pin_pipelines.clickhouse import ClickHouseUnavailable, migrate_clickhouse, open_clickhouse
from pin_pipelines.devstats.dim import insert_events
from pin_pipelines.devstats.events import parse_event
from pin_pipelines.devstats.operator import operator_actor
from pin_pipelines.devstats.reads import labels
from tests.support.api import ApiProcess
from tests.support.devstats import Group
from tests.support.idp import IdentityProvider, api_env

SERVER_URL = os.environ.get(
    "PIN_BENCH_CLICKHOUSE_SERVER_URL", "clickhouse://default@127.0.0.1:9000/pin_dev_stats"
)
WARMUP_CALLS = 200


def open_loop(
    make_call: Callable[[], Callable[[], None]], rate: float, seconds: float, workers: int
) -> tuple[list[float], int]:
    """Latencies (s) of rate × seconds calls, one scheduled every 1/rate s, each measured from
    its scheduled start, and how many failed (an API answer other than 200: a 503 when its
    clients were busy for 10 s); `make_call` gives each worker its own call (connection)."""
    count = int(rate * seconds)
    starts: queue.Queue[float] = queue.Queue()
    first = time.perf_counter() + 0.2
    for n in range(count):
        starts.put(first + n / rate)
    latencies: list[float] = []
    failed: list[str] = []

    def worker() -> None:
        call = make_call()
        while True:
            try:
                start = starts.get_nowait()
            except queue.Empty:
                return
            delay = start - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            try:
                call()
            except (AssertionError, ClickHouseUnavailable) as exc:
                failed.append(str(exc))
                continue
            latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, len(failed)


class KeepAlive:
    """One keep-alive HTTP/1.1 connection sending the same request (bytes built once) and
    reading its answer by Content-Length: a client of ~0.05 ms of CPU per request, where an
    HTTP library spends ~1 ms of this process's (shared) CPU, which the API's latency would
    then carry."""

    def __init__(self, port: int, request: bytes) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.request = request
        self.buffer = b""

    def call(self) -> None:
        self.sock.sendall(self.request)
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self._recv()
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        while len(rest) < length:
            rest += self._recv()
        self.buffer = rest[length:]
        if status != 200:
            raise AssertionError(f"HTTP {status}: {rest[:length]!r}")

    def _recv(self) -> bytes:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the API closed the connection")
        return chunk


def store_groups(url: str, developer: uuid.UUID, count: int) -> list[uuid.UUID]:
    """`count` groups of `developer`, one insert (the loader's write); their ids."""
    groups = [Group(developer_id=developer) for _ in range(count)]
    events = [parse_event(json.dumps(g.event(1)).encode()) for g in groups]
    with open_clickhouse(url) as ch:
        migrate_clickhouse(ch)
        insert_events(ch, events)
        ch.confirm_insert()
    return [g.id for g in groups]


@contextmanager
def engine_url(engine: str) -> Iterator[str]:
    if engine == "server":
        yield SERVER_URL
        return
    folder = Path(tempfile.mkdtemp(prefix="pin-bench-api-"))
    try:
        yield f"chdb://{folder / 'chdb'}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(engine: str, args: argparse.Namespace, idp: IdentityProvider) -> dict[str, Any]:
    developer = uuid.uuid4()
    with engine_url(engine) as url, tempfile.TemporaryDirectory() as logs:
        stored = store_groups(url, developer, args.groups)
        stored_share = int(args.ids * 0.9)
        asked = ",".join(
            str(i)
            for i in random.sample(stored, stored_share)
            + [uuid.uuid4() for _ in range(args.ids - stored_share)]
        )
        wanted = [uuid.UUID(i) for i in asked.split(",")]
        token = idp.token(developer, exp=int(time.time()) + 3600)
        api = ApiProcess({**api_env(idp), "PIN_CLICKHOUSE_URL": url}, Path(logs))
        try:
            api.wait_until_healthy()
            actor = operator_actor(developer)
            with ClickHousePool(url) as pool:

                def direct() -> Callable[[], None]:
                    def call() -> None:
                        with pool.client() as ch:
                            found = labels(ch, actor, wanted)
                        assert len(found) == args.ids

                    return call

                request = (
                    f"GET /v1/layout-groups/labels?ids={asked} HTTP/1.1\r\n"
                    f"Host: 127.0.0.1:{api.port}\r\nAuthorization: Bearer {token}\r\n\r\n"
                ).encode()

                def through_api() -> Callable[[], None]:
                    return KeepAlive(api.port, request).call

                phases = {"direct": direct, "api": through_api}
                for make in phases.values():  # warm-up: connections, caches, the JIT-less rest
                    open_loop(make, args.rate, WARMUP_CALLS / args.rate, args.workers)
                found: dict[str, list[float]] = {"direct": [], "api": []}
                failed = {"direct": 0, "api": 0}
                api_cpu = 0.0
                for phase in range(args.phases):
                    name = ("direct", "api")[phase % 2]
                    cpu_before = cpu_seconds(api.process.pid)
                    latencies, failures = open_loop(
                        phases[name], args.rate, args.seconds, args.workers
                    )
                    found[name] += latencies
                    failed[name] += failures
                    if name == "api":
                        api_cpu += cpu_seconds(api.process.pid) - cpu_before
            assert api.stop() == 0
            # The API's own view (its request log: arrival to the answer's start), of the
            # measured requests (the last ones it logged): where the client's latency goes.
            logged = [
                line["ms"] / 1000
                for line in api.log_events("api_request")
                if line["route"] == "labels" and line["status"] == 200
            ]
            inside = quantiles(logged[-len(found["api"]) :])
        finally:
            api.kill()
    direct_q, api_q = quantiles(found["direct"]), quantiles(found["api"])
    return {
        "direct": {**direct_q, "failed": failed["direct"]},
        "api": {**api_q, "failed": failed["api"]},
        "api_inside": {key: inside[key] for key in ("p50_ms", "p99_ms")},
        "ratio_p50": round(api_q["p50_ms"] / direct_q["p50_ms"], 2),
        "ratio_p99": round(api_q["p99_ms"] / direct_q["p99_ms"], 2),
        "api_cpu_ms_per_request": round(api_cpu * 1000 / max(1, len(found["api"])), 3),
        "goal_met": not failed["api"]
        and api_q["p99_ms"] < 50
        and api_q["p99_ms"] <= 2 * direct_q["p99_ms"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--engines", default="server,embedded")
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second")
    parser.add_argument("--ids", type=int, default=100, help="ids per labels request")
    parser.add_argument("--groups", type=int, default=1000, help="groups stored")
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds per phase")
    parser.add_argument("--phases", type=int, default=4, help="alternating direct/api phases")
    parser.add_argument("--workers", type=int, default=16, help="client threads")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "rate": args.rate,
        "ids": args.ids,
        "seconds_per_phase": args.seconds,
        "phases": args.phases,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    with IdentityProvider() as idp:
        for engine in args.engines.split(","):
            result[engine] = measure(engine, args, idp)
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
