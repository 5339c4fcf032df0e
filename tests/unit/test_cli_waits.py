"""The tests' waits on a `pin` process end: tests/support/cli.py. A CI run's parallel lane hung
until CI's limit in a loop that sampled while a loader ran, polling the loader with its pipes
unread and no deadline."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.cli import finish, sample_until_done

#: Writes 300 KB to stderr, several times a pipe's buffer, then ends.
CHATTY = "import sys\nfor _ in range(3000): sys.stderr.write('x' * 99 + '\\n')\nprint('done')"
SLEEPER = "import time; time.sleep(60)"


def _python(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_a_chatty_process_ends_while_sampled() -> None:
    """Tried: a child that fills its stderr pipe many times over; sampled, it is read meanwhile
    and ends (a `poll()` loop would wait on it forever), and nothing it wrote is lost."""
    samples = []
    done = sample_until_done(_python(CHATTY), lambda: samples.append(1), timeout=60)
    assert (done.returncode, done.stdout, len(done.stderr)) == (0, "done\n", 300_000)


@pytest.mark.parametrize("wait", ["finish", "sample_until_done"])
def test_a_process_that_outlives_the_bound_is_killed_and_reported(wait: str) -> None:
    """Tried: a child that sleeps past the bound; the wait kills it and fails in one line."""
    process = _python(SLEEPER)
    with pytest.raises(AssertionError, match="still running 1s later"):
        if wait == "finish":
            finish(process, timeout=1)
        else:
            sample_until_done(process, lambda: None, timeout=1)
    assert process.returncode == -9
