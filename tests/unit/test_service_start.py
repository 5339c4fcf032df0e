"""A local service that dies while it starts is reported with what it printed last, not with
the previous run's log (CI once read a broker's earlier lines under "Kafka exited during
start-up", while the new process had died before its exec)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pin_pipelines.errors import PinError
from pin_pipelines.stack.process import start_detached, wait_until


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
