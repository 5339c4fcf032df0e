"""`pin serve` and `pin dev`: the Dagster processes on the instance; a stop ends the runs first.

One code server for the code location (`dagster api grpc`, started and restarted here) serves the
daemon and the webserver alike through a `grpc_server` workspace that `pin serve` writes into
DAGSTER_HOME. With the repository's `python_module` workspace each of them kept code servers of
its own, and the daemon started a new one at each of its workspace reloads (every 60 s), each
importing Dagster and the whole package (issue 48).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

import dagster as dg
import yaml
from dagster._core.errors import DagsterUserCodeUnreachableError
from dagster._core.workspace.load_target import WorkspaceFileTarget
from dagster._grpc.client import DagsterGrpcClient

from pin_pipelines.config import SOURCE_ROOT, Settings, dagster_pg_dsn, with_dead_peer_bounds
from pin_pipelines.dagster_instance import TEMPLATE, write_instance_yaml
from pin_pipelines.db import connect
from pin_pipelines.defs.sensors import IN_FLIGHT
from pin_pipelines.defs.stopping import STOPPING_MARKER
from pin_pipelines.errors import PinError
from pin_pipelines.signals import stop_requested
from pin_pipelines.stack.process import free_port


def prepare_dagster_home(settings: Settings) -> dict[str, str]:
    """DAGSTER_HOME gets the repository's dagster.yaml with the drain runs' limit from the
    settings (dagster_instance.py); returns the child environment. A DAGSTER_HOME that is the
    repository itself keeps its dagster.yaml as it is: then the sensor alone applies the limit."""
    home = settings.dagster_home
    home.mkdir(parents=True, exist_ok=True)
    target = home / "dagster.yaml"
    if TEMPLATE.resolve() != target.resolve():
        write_instance_yaml(settings, target)
    # Fail here, clearly, rather than in two child processes' tracebacks.
    connect(dagster_pg_dsn(settings.dagster_pg_url)).close()
    return {
        **os.environ,
        "DAGSTER_HOME": str(home),
        # Every daemon, webserver, code server and run worker connection to the storage is
        # bounded like the project's own (a blackholed server is an error, not a 15-minute hang).
        "PIN_DAGSTER_PG_URL": with_dead_peer_bounds(settings.dagster_pg_url),
        "PIN_PG_DSN": settings.pg_dsn,
        "PIN_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "PIN_CLICKHOUSE_URL": settings.clickhouse_url,
    }


def _bin(name: str) -> str:
    sibling = Path(sys.executable).with_name(name)
    found = str(sibling) if sibling.exists() else shutil.which(name)
    if not found:
        raise PinError(f"{name} is not installed (pip install -e .)")
    return found


#: The code location: the repository's workspace.yaml (one `python_module`), which plain `dagster
#: dev -w workspace.yaml` loads too. `pin serve` serves it from its one code server.
WORKSPACE = SOURCE_ROOT / "workspace.yaml"
#: The workspace the daemon and the webserver of `pin serve` and `pin dev` load: that location by
#: `grpc_server`, on the code server below. Written into DAGSTER_HOME at each start.
GRPC_WORKSPACE = "grpc_workspace.yaml"
CODE_SERVER_HOST = "127.0.0.1"
#: The code server loads the package before it answers; Dagster gives a code server it starts
#: itself as long (the instance's code_server_process_startup_timeout default).
CODE_SERVER_START_SECONDS = 180.0
#: A code server that dies is started again, unless it died this many times in a row, each within
#: CODE_SERVER_STEADY_SECONDS of its start: then it cannot run here (its port taken, the
#: environment broken), and `pin serve` stops with its exit code rather than loop.
CODE_SERVER_QUICK_EXITS = 3
CODE_SERVER_STEADY_SECONDS = 60.0
#: A stop ends within this of the signal, whatever its steps take: Kubernetes and Docker kill
#: what is left 30 s after their stop signal. Each step waits only for what is left of it (under
#: a load average of 16 the steps' own bounds once added up past 30 s).
STOP_SECONDS = 27.0
#: Of which the runs in flight get this long: a stop ends a drain after its project in hand (one
#: stuck for 5 s is cancelled), a relay after its batch in hand, a load after its batch in hand.
WIND_DOWN_SECONDS = 20.0
#: Then the runs still in flight are canceled and get this long to end.
CANCELED_RUNS_SECONDS = 3.0
#: The rest is the processes': the daemon and the webserver, then the code server, then what is
#: left below (SIGTERM, then SIGKILL), each leaving this much of it to the next ones.
PROCESS_STEP_SECONDS = 1.0
#: A child that exits by itself (no stop asked) leaves the others this long to exit on SIGTERM.
CHILD_STOP_SECONDS = 5.0
#: prctl(2): orphaned descendants are re-parented to this process instead of init.
PR_SET_CHILD_SUBREAPER = 36
#: prctl(2): the signal this process gets when its parent dies.
PR_SET_PDEATHSIG = 1
QUEUED = dg.DagsterRunStatus.QUEUED
CANCELING = dg.DagsterRunStatus.CANCELING
#: Runs with a run worker (or about to get one): what a stop waits for.
LAUNCHED = [s for s in (*IN_FLIGHT, CANCELING) if s != QUEUED]
#: Launched, but the run worker has not started the run: canceling it loses nothing.
NOT_YET_STARTED = [dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING]
STOP_CANCEL_MESSAGE = "Canceled by the stop of pin serve before it started."


def grpc_workspace(settings: Settings) -> str:
    """Where `pin serve` writes the workspace its daemon and webserver load."""
    return str(settings.dagster_home / GRPC_WORKSPACE)


def _ui_args(settings: Settings) -> list[str]:
    """Workspace and loopback address shared by dagster-webserver and dagster dev."""
    return ["-w", grpc_workspace(settings), "-h", "127.0.0.1", "-p", str(settings.dagster_port)]


def serve(settings: Settings) -> None:
    """The code server, dagster-daemon and dagster-webserver until SIGTERM or SIGINT, as in
    production."""
    _supervise(
        settings,
        {
            "dagster-daemon": [_bin("dagster-daemon"), "run", "-w", grpc_workspace(settings)],
            "dagster-webserver": [_bin("dagster-webserver"), *_ui_args(settings)],
        },
    )


def dagster_dev(settings: Settings) -> None:
    """`dagster dev` on the project's instance and code server (local use), stopped as `pin
    serve` stops: a `dagster dev` stopped by the terminal's Ctrl-C leaves its run workers to die
    with the signal (FAILURE runs), and its runs to outlive it until their budget ends. Given a
    `grpc_server` workspace, `dagster dev` starts no code server of its own. The UI's reload reads
    the definitions again from that server; a code change needs `pin dev` started again."""
    _supervise(settings, {"dagster dev": [_bin("dagster"), "dev", *_ui_args(settings)]})


class _CodeServer:
    """`dagster api grpc` serving the location of workspace.yaml on a loopback port, for the
    daemon and the webserver: started before them, stopped after them, and started again on
    the same port when it dies (they find it there again by themselves, see docs/production.md).

    `dagster api grpc`, not the `dagster code-server start` proxy that `dagster dev` runs: the
    proxy is a second process that forwards every call to a `dagster api grpc` child it does
    not restart when that child dies (only the UI's reload replaces it), so its death would
    leave the location unreachable with the proxy still alive. Here the process that loads the
    code is this process's child: its death is seen and repaired at once. What the proxy adds,
    code reloaded without a restart, is a development convenience `pin serve` does not need."""

    def __init__(self, settings: Settings, env: dict[str, str], sweeper: _Sweeper) -> None:
        (origin,) = WorkspaceFileTarget(paths=[str(WORKSPACE)]).create_origins()
        self.port = settings.code_server_port or free_port()
        self.argv = [
            _bin("dagster"),
            *("api", "grpc", "-h", CODE_SERVER_HOST, "-p", str(self.port)),
            *("--location-name", origin.location_name),
            *origin.loadable_target_origin.get_cli_args(),
        ]
        self._env = env
        self._sweeper = sweeper
        self._quick_exits = 0
        Path(grpc_workspace(settings)).write_text(
            f"# Written by `pin serve` / `pin dev` at each start: {WORKSPACE.name}'s location on\n"
            "# the code server they run (pin_pipelines/serve.py).\n"
            + yaml.safe_dump(
                {
                    "load_from": [
                        {
                            "grpc_server": {
                                "host": CODE_SERVER_HOST,
                                "port": self.port,
                                "location_name": origin.location_name,
                            }
                        }
                    ]
                },
                sort_keys=False,
            )
        )
        self._start()

    def _start(self) -> None:
        self.process = subprocess.Popen(
            self.argv,
            env=self._env,
            cwd=SOURCE_ROOT,
            process_group=0,
            preexec_fn=_dies_with_this_process(),
        )
        self.started = time.monotonic()
        self._sweeper.watch(self.process.pid)

    @property
    def pid(self) -> int:
        return self.process.pid

    def serving(self) -> bool:
        try:
            DagsterGrpcClient(port=self.port, host=CODE_SERVER_HOST).ping("")
        except DagsterUserCodeUnreachableError:
            return False
        return True

    def wait_until_serving(self, stopping: Callable[[], bool]) -> None:
        """Until it answers (or a stop is asked for): the daemon and the webserver then load
        the location at their start instead of logging it unreachable until it is."""
        deadline = time.monotonic() + CODE_SERVER_START_SECONDS
        while not stopping() and not self.serving():
            if self.process.poll() is not None:
                raise PinError(
                    f"the code server exited with code {self.process.returncode} while "
                    f"starting on 127.0.0.1:{self.port} (its log above)"
                )
            if time.monotonic() > deadline:
                raise PinError(
                    f"the code server did not answer within {CODE_SERVER_START_SECONDS:g}s "
                    f"on 127.0.0.1:{self.port}"
                )
            time.sleep(0.5)

    def keep_alive(self) -> None:
        """Start it again if it died."""
        code = self.process.poll()
        if code is None:
            return
        lived = time.monotonic() - self.started
        self._quick_exits = self._quick_exits + 1 if lived < CODE_SERVER_STEADY_SECONDS else 1
        if self._quick_exits >= CODE_SERVER_QUICK_EXITS:
            raise PinError(
                f"the code server exited {self._quick_exits} times in a row within "
                f"{CODE_SERVER_STEADY_SECONDS:g}s of its start (last with code {code})"
            )
        print(
            f"pin: the code server exited with code {code} after {lived:.0f}s; starting "
            f"another on 127.0.0.1:{self.port}",
            file=sys.stderr,
        )
        self._start()

    def stop(self, end: float) -> None:
        """SIGTERM, SIGKILL at monotonic time `end`."""
        if self.process.poll() is None:
            self.process.terminate()
        _wait_or_kill(self.process, end)


def _supervise(settings: Settings, commands: dict[str, list[str]]) -> None:
    """Run `commands` until SIGTERM or SIGINT (then wind the runs down and stop them), or until
    one of them exits.

    The handlers go in before the children start, so the children start with SIGTERM and SIGINT
    at their defaults even when this process inherited them ignored (see pin_pipelines.signals).
    """
    env = prepare_dagster_home(settings)
    marker = settings.dagster_home / STOPPING_MARKER
    marker.unlink(missing_ok=True)  # left by a stop that did not finish
    stopping = stop_requested()
    _adopt_orphans()
    # A process group of their own: Ctrl-C in the terminal signals the foreground group, and it
    # must reach `pin serve` alone, which stops the runs first and its children after (run
    # workers that got the signal themselves ended FAILURE, and a run still launching was
    # marked failed when its code server went down under it). Killed itself (SIGKILL), `pin
    # serve` stops nothing: its children die with it (PR_SET_PDEATHSIG), and the sweeper kills
    # what is left in their groups (their code servers, run workers), see sweeper.py.
    sweeper = _Sweeper()
    children: dict[str, subprocess.Popen[bytes]] = {}
    code_server = _CodeServer(settings, env, sweeper)
    end: float | None = None  # when the stop must be over (monotonic)
    try:
        code_server.wait_until_serving(stopping)
        for name, argv in commands.items():
            if stopping():
                break
            children[name] = subprocess.Popen(
                argv,
                env=env,
                cwd=SOURCE_ROOT,
                process_group=0,
                preexec_fn=_dies_with_this_process(),
            )
            sweeper.watch(children[name].pid)
        print(
            f"pin: Dagster UI on http://127.0.0.1:{settings.dagster_port} "
            f"(DAGSTER_HOME={env['DAGSTER_HOME']}, code server on 127.0.0.1:{code_server.port});"
            f" Ctrl-C stops {' and '.join(children)} and the code server",
            file=sys.stderr,
        )
        while not stopping() and all(child.poll() is None for child in children.values()):
            sweeper.keep_alive()
            code_server.keep_alive()
            _reap_adopted(keep={sweeper.pid, code_server.pid, *(c.pid for c in children.values())})
            time.sleep(0.5)
        if stopping():
            end = time.monotonic() + STOP_SECONDS
            _wind_down(settings, env, marker)
    finally:
        if end is None:  # a child exited by itself, or this process failed
            end = time.monotonic() + 3 * CHILD_STOP_SECONDS
        marker.unlink(missing_ok=True)
        # The code server last: the daemon and the webserver launch runs and terminate them
        # through it until they are gone.
        for child in children.values():
            if child.poll() is None:
                child.terminate()
        for child in children.values():
            _wait_or_kill(child, end - 2 * PROCESS_STEP_SECONDS)
        code_server.stop(end - PROCESS_STEP_SECONDS)
        _stop_descendants(end, spare=sweeper.pid)
        sweeper.close(end)
        if stopping():
            _cancel_unstarted(settings, env)
    if not stopping():
        for name, child in children.items():
            if child.returncode not in (None, 0, -signal.SIGTERM):
                raise PinError(f"{name} exited with code {child.returncode}")


def _adopt_orphans() -> None:
    """Make `pin serve` the subreaper of what it starts: a run worker whose parent (the code
    server) died first stays its descendant, so `_stop_descendants` finds it (a code server once
    outlived a stop by minutes, parented to init)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(
            f"pin: prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}; orphaned "
            "Dagster processes are not stopped with pin serve",
            file=sys.stderr,
        )


def _dies_with_this_process() -> Callable[[], None]:
    """A preexec_fn: the child gets SIGKILL when this process dies (PR_SET_PDEATHSIG), and exits
    at once if this process died before the setting took (the child was then re-parented). libc
    is looked up here, before the fork; `pin serve` has one thread when it starts its children."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


class _Sweeper:
    """`python -m pin_pipelines.sweeper`: kills what is left in the children's process groups
    once this process is gone, however it went (sweeper.py). Started again if it dies, so that
    a SIGKILL to `pin serve` later still leaves nothing behind."""

    def __init__(self) -> None:
        self.groups: list[int] = []
        self._start()

    def _start(self) -> None:
        read, write = os.pipe()  # not inheritable: only this process holds the write end
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pin_pipelines.sweeper", str(os.getpid())],
                stdin=read,
                cwd=SOURCE_ROOT,
                process_group=0,  # not reached by a signal to this process's group
            )
        finally:
            os.close(read)
        self.pipe: IO[bytes] = os.fdopen(write, "wb", buffering=0)
        for group in self.groups:
            self.pipe.write(f"{group}\n".encode())

    @property
    def pid(self) -> int:
        return self.process.pid

    def watch(self, group: int) -> None:
        """Sweep process group `group` once this process is gone."""
        self.groups.append(group)
        with suppress(BrokenPipeError):  # it died: keep_alive starts another
            self.pipe.write(f"{group}\n".encode())

    def keep_alive(self) -> None:
        if self.process.poll() is not None:
            print(
                f"pin: the sweeper exited ({self.process.returncode}); starting another",
                file=sys.stderr,
            )
            with suppress(BrokenPipeError):
                self.pipe.close()
            self._start()

    def close(self, end: float) -> None:
        """End the pipe: the sweeper kills what is left in the groups (nothing, after a clean
        stop) and exits; killed if it has not by monotonic time `end`."""
        with suppress(BrokenPipeError):
            self.pipe.close()
        _wait_or_kill(self.process, end)


#: However late a step comes, its process gets this long to exit before it is killed.
LEAST_WAIT_SECONDS = 0.2


def _wait_or_kill(process: subprocess.Popen[bytes], end: float) -> None:
    """Wait for `process` until monotonic time `end` (LEAST_WAIT_SECONDS at least), then
    SIGKILL it and reap it."""
    try:
        process.wait(timeout=max(end - time.monotonic(), LEAST_WAIT_SECONDS))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _descendants() -> list[int]:
    """Every live descendant of this process, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [os.getpid()]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += children
        frontier = children
    return found


def _stop_descendants(end: float, spare: int | None = None) -> None:
    """SIGTERM to what is left below this process (orphans it adopted, their children), SIGKILL
    at monotonic time `end` (LEAST_WAIT_SECONDS at least), and reap the adopted ones: nothing of
    the instance outlives `pin serve`. `spare` (the sweeper) is left to end by itself."""
    left = [pid for pid in _descendants() if pid != spare]
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            with suppress(ProcessLookupError):
                os.kill(pid, signum)
        deadline = max(end, time.monotonic() + LEAST_WAIT_SECONDS)
        end = deadline + PROCESS_STEP_SECONDS  # after SIGKILL: the reaping
        while left and time.monotonic() < deadline:
            _reap_adopted(keep={spare} if spare else set())
            time.sleep(0.1)
            left = [pid for pid in left if pid in _descendants()]
    _reap_adopted(keep={spare} if spare else set())


def _reap_adopted(keep: set[int]) -> None:
    """Collect exited orphans (children only by adoption, such as the run workers of a code
    server that died: no Popen waits for them). The children in `keep` are left to their Popen,
    which would otherwise read a stolen exit status as 0."""
    while True:
        try:
            exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if exited is None or exited.si_pid in keep:
            return
        with suppress(ChildProcessError):
            os.waitpid(exited.si_pid, 0)


@contextmanager
def open_instance(
    settings: Settings, env: dict[str, str] | None = None
) -> Iterator[dg.DagsterInstance]:
    """The project's Dagster instance in this process (`pin dagster prune`, a clean stop)."""
    env = env or prepare_dagster_home(settings)
    os.environ.update(env)  # the instance's dagster.yaml reads its storage URL from the env
    with dg.DagsterInstance.from_config(str(settings.dagster_home)) as instance:
        yield instance


def _wind_down(settings: Settings, env: dict[str, str], marker: Path) -> None:
    """A clean stop: no new runs (the marker stops the sensors and schedules, drains end after
    the project in hand), runs queued are canceled (they had not started: the sensors and
    schedules ask for them again after the next start), and the runs launched are waited for
    until they end. Only then are the daemon and the webserver stopped, so no run is left
    launching on a code server that is shutting down (a FAILURE for a clean stop).

    Queued runs are canceled on every pass, not once: a schedule or sensor tick evaluated just
    before the marker submits its run after it (both check schedules fire on the same minute),
    and a run left queued was dequeued by the daemon as it was being stopped and failed
    ("marked as failed from outside the execution context"). Bounded: past WIND_DOWN_SECONDS
    the runs still in flight are canceled (a started run's worker is interrupted and ends
    CANCELED, not FAILURE) and get CANCELED_RUNS_SECONDS more."""
    deadline = time.monotonic() + WIND_DOWN_SECONDS
    marker.touch()
    print("pin: stopping: no new runs; waiting for the runs in flight", file=sys.stderr)
    with open_instance(settings, env) as instance:
        while _cancel_queued(instance):
            if time.monotonic() > deadline:
                print(
                    f"pin: runs still in flight after {WIND_DOWN_SECONDS:g}s; canceling them",
                    file=sys.stderr,
                )
                _cancel_launched(instance)
                wait_until_ended = deadline + CANCELED_RUNS_SECONDS
                while _cancel_queued(instance) and time.monotonic() < wait_until_ended:
                    time.sleep(0.5)
                return
            time.sleep(0.5)


def _cancel_queued(instance: dg.DagsterInstance) -> bool:
    """Cancel the runs still queued (as the run coordinator does: they never started); whether
    any run of the instance is still in flight. A run the daemon dequeues meanwhile is launched
    CANCELED, and its run worker does not start it."""
    records = instance.get_run_records(dg.RunsFilter(statuses=[*IN_FLIGHT, CANCELING]))
    for record in records:
        if record.dagster_run.status == QUEUED:
            instance.report_run_canceled(record.dagster_run, message=STOP_CANCEL_MESSAGE)
    return any(r.dagster_run.status != QUEUED for r in records)


def _cancel_launched(instance: dg.DagsterInstance) -> None:
    """Past the wind-down's bound: a run that has not started yet is marked CANCELED (its run
    worker, if it comes up, does not start it); a started one is terminated through the run
    launcher (CANCELING, then its worker is interrupted and ends it CANCELED)."""
    for record in instance.get_run_records(dg.RunsFilter(statuses=LAUNCHED)):
        run = record.dagster_run
        if run.status in NOT_YET_STARTED:
            instance.report_run_canceled(run, message=STOP_CANCEL_MESSAGE)
        elif run.status == dg.DagsterRunStatus.STARTED:
            with suppress(Exception):  # its worker already gone: run monitoring settles it
                instance.run_launcher.terminate(run.run_id)


def _cancel_unstarted(settings: Settings, env: dict[str, str]) -> None:
    """After the daemon, the webserver and everything below them are stopped: a run still
    queued or launching has no process left to start it (a tick submitted it as the daemon was
    stopping); it is marked CANCELED rather than left for run monitoring to fail at the next
    start."""
    with open_instance(settings, env) as instance:
        for record in instance.get_run_records(dg.RunsFilter(statuses=[QUEUED, *NOT_YET_STARTED])):
            instance.report_run_canceled(record.dagster_run, message=STOP_CANCEL_MESSAGE)
