"""Run the installed `pin` command as a user would, and read its JSON summary; wait for (or stop)
`pin` processes a test started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

PIN = str(Path(sys.executable).with_name("pin"))


def run_pin(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PIN, *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def summary(result: subprocess.CompletedProcess[str]) -> Any:
    """The contract: the last line on stdout is one JSON object."""
    assert result.returncode == 0, f"pin failed ({result.returncode}): {result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got: {result.stderr!r}"
    assert lines[0].startswith("pin"), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


def finish(process: subprocess.Popen[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Wait for a `pin` process; one that outlives `timeout` is killed and reported hung."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _hung(process, timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def sample_until_done(
    process: subprocess.Popen[str], sample: Callable[[], object], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Call `sample` again and again while `process` runs, reading its pipes meanwhile (a process
    whose unread stderr fills its pipe blocks, and a loop on `poll()` alone would wait for it
    forever); like `finish`, a process that outlives `timeout` is killed and reported hung."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:  # communicate() may be called again after its timeout without losing output
            out, err = process.communicate(timeout=0.2)
        except subprocess.TimeoutExpired:
            sample()
            continue
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)
    _hung(process, timeout)


def _hung(process: subprocess.Popen[str], timeout: float) -> NoReturn:
    process.kill()
    _, err = process.communicate()
    raise AssertionError(
        f"{process.args!r:.80} still running {timeout:.0f}s later; stderr: {err[-600:]!r}"
    ) from None


def load_summary(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-600:]
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return summary


def stop_all(*processes: subprocess.Popen[str]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate()
