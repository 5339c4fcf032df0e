"""A local service that dies while it starts is reported with what it printed last, not with
the previous run's log (CI once read a broker's earlier lines under "Kafka exited during
start-up", while the new process had died before its exec); and a service is known by its pid
and start time, never by a pid that has since gone to another process or thread."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

from pin_pipelines.errors import PinError
from pin_pipelines.stack.process import (
    pid_alive,
    read_pid,
    start_detached,
    started_at,
    stop_pid,
    wait_until,
)


def test_a_service_that_exits_while_starting_is_reported_with_its_own_last_words(
    tmp_path: Path,
) -> None:
    """Tried: a process that prints a line and exits 3 at once, its service log holding an
    earlier run's last line and then a ClickHouse-style stack trace. The one-line error names
    it, quotes its output, then the log's last line that is not a stack frame."""
    log = tmp_path / "server.log"
    log.write_text(
        "an earlier run's last line\n"
        + "".join(f"{n}. /lib/libclickhouse.so(+0x{n:x}) [0x7f{n:x}]\n" for n in range(12))
    )
    output = tmp_path / "stdout.log"
    pid = start_detached(
        ["sh", "-c", "echo 'fatal: cannot start'; exit 3"],
        pidfile=tmp_path / "service.pid",
        logfile=output,
    )
    with pytest.raises(PinError) as failed:
        wait_until(
            lambda: False, timeout=30, what="The service", logfile=log, pid=pid, output=output
        )
    message = str(failed.value)
    assert message.startswith("The service exited during start-up (exit code 3); see "), message
    assert message.index("fatal: cannot start") < message.index("an earlier run's last line")
    assert "libclickhouse" not in message
    assert "\n" not in message


def test_a_service_killed_while_starting_is_reported_with_the_signal(tmp_path: Path) -> None:
    """Tried: a process that SIGKILLs itself before it prints anything (what a broker of a CI run
    did: no output and no log line, and no way to tell a kill from a crash). The error names the
    signal."""
    output = tmp_path / "stdout.log"
    pid = start_detached(
        ["sh", "-c", "kill -KILL $$"], pidfile=tmp_path / "service.pid", logfile=output
    )
    with pytest.raises(PinError) as failed:
        wait_until(lambda: False, timeout=30, what="The service", pid=pid, output=output)
    assert str(failed.value).startswith("The service exited during start-up (killed by SIGKILL)")


def test_a_dead_service_whose_pid_is_now_a_thread_is_not_running(tmp_path: Path) -> None:
    """Tried: a pid file naming the id of a live thread of this process (thread ids come from the
    pids' counter, and /proc and kill(2) answer to them; after a broker's kill in a CI run its pid
    was some server's thread when the test started it again: "Kafka exited during start-up",
    with no output and no log line). The service reads as down, so `up` starts it, and its stop
    signals nothing."""
    ready, done = threading.Event(), threading.Event()
    ids: list[int] = []

    def hold() -> None:
        ids.append(threading.get_native_id())
        ready.set()
        done.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        ready.wait(30)
        pidfile = tmp_path / "service.pid"
        for text in (f"{ids[0]}\n", f"{ids[0]} {started_at(os.getpid())}\n"):
            pidfile.write_text(text)
            assert read_pid(pidfile) is None, text
            assert not stop_pid(pidfile, grace_seconds=1)  # this process got no SIGTERM
        assert not pid_alive(ids[0])
    finally:
        done.set()
        thread.join()


def test_a_pid_taken_by_another_process_is_not_the_service(tmp_path: Path) -> None:
    """Tried: a pid file naming a live process that started after the recorded start time (the
    service died, and its pid went to a new process). The service reads as down and its stop
    leaves the other process running; the service itself, by its own pid file, reads as running
    and is stopped."""
    stranger = subprocess.Popen(["sleep", "60"])
    pidfile = tmp_path / "service.pid"
    try:
        start = started_at(stranger.pid)
        assert start is not None
        pidfile.write_text(f"{stranger.pid} {start - 1}\n")
        assert read_pid(pidfile) is None
        assert not stop_pid(pidfile, grace_seconds=1)
        assert stranger.poll() is None

        own = tmp_path / "own.pid"
        pid = start_detached(["sleep", "60"], pidfile=own, logfile=tmp_path / "own.log")
        assert read_pid(own) == pid
        assert stop_pid(own, grace_seconds=10)
        assert read_pid(own) is None
    finally:
        stranger.kill()
        stranger.wait()
