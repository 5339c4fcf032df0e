"""The embedded ClickHouse folder's owner and its readers (pin_pipelines/clickhouse/embedded.py):
a reader that looks for an owner just before one takes the folder waits for it to answer, and an
owner that starts while a reader has the folder open waits for the reader.

Real chdb in processes of their own (this process may hold another folder: chdb opens one per
process); the first test's reader is this process.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pin_pipelines.clickhouse import owner
from pin_pipelines.clickhouse.embedded import EmbeddedClickHouse

OWNER = """
import sys
from pathlib import Path
from pin_pipelines.clickhouse.embedded import EmbeddedClickHouse
ch = EmbeddedClickHouse(Path(sys.argv[1]), serve=True)
print("serving" if ch.serving else "not serving", flush=True)
sys.stdin.read()
ch.close()
"""


#: A process that opens the folder itself (no owner runs), says so, and holds it until its stdin
#: is closed.
READER = """
import sys
from pathlib import Path
from pin_pipelines.clickhouse.embedded import EmbeddedClickHouse
ch = EmbeddedClickHouse(Path(sys.argv[1]))
print("open" if ch.rows("SELECT 1") == [(1,)] and not ch.serving else "not open", flush=True)
sys.stdin.read()
ch.close()
"""
#: A process that takes the folder as its owner, its first three looks at who has the folder
#: open answering "nobody" (the reader below had just closed it, as in the CI run).
OWNER_AFTER_A_READER = """
import sys
from pathlib import Path
from pin_pipelines.clickhouse import embedded
real, looks = embedded._holder, []
def holder(folder):
    looks.append(folder)
    return embedded._FREE if len(looks) <= 3 else real(folder)
embedded._holder = holder
ch = embedded.EmbeddedClickHouse(Path(sys.argv[1]), serve=True)
print("serving" if ch.serving and ch.rows("SELECT 1") == [(1,)] else "not serving", flush=True)
ch.close()
"""


@contextmanager
def holding_process(script: str, folder: Path, says: str) -> Iterator[subprocess.Popen[str]]:
    """A process running `script` on `folder`, once it printed `says`; it holds the folder until
    its stdin is closed (here at the latest), and is killed if it does not end then."""
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        assert process.stdout.readline().strip() == says
        yield process
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


@pytest.fixture
def owning_process(tmp_path: Path) -> Iterator[Path]:
    """A process that owns the folder `tmp_path/chdb` and answers on its socket."""
    folder = tmp_path / "chdb"
    with holding_process(OWNER, folder, "serving"):
        yield folder


def _first_call(returns: Any, real: Callable[..., Any]) -> Callable[..., Any]:
    """`real`, except that its first call returns `returns`."""
    calls = []

    def patched(*args: Any) -> Any:
        calls.append(args)
        return returns if len(calls) == 1 else real(*args)

    return patched


def test_a_reader_that_looked_before_an_owner_took_the_folder_waits_for_it(
    owning_process: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tried: the interleaving a check run launched beside the load run met in a `pin serve`
    stop test (1 stop in 20): the reader found no owner answering and the owner lock free, and
    by the time it opened the folder the load run had taken the lock and the folder, not yet
    answering on its socket. The reader's three looks (its connection, its wait for an owner,
    the lock) are made to see that moment (their first calls answer as they did then) while a
    real owner holds the folder. Before, the reader failed: "… is in use by process N; chdb
    allows one process per folder". Now it waits for
    the owner and its statement is answered there."""
    monkeypatch.setattr(owner, "connect", _first_call(None, owner.connect))
    monkeypatch.setattr(owner, "wait_for_owner", _first_call(None, owner.wait_for_owner))
    monkeypatch.setattr(owner, "owner_lock_held", _first_call(False, owner.owner_lock_held))
    reader = EmbeddedClickHouse(owning_process)
    try:
        assert reader.rows("SELECT 1") == [(1,)]
        assert not reader.serving
    finally:
        reader.close()


def test_an_owner_that_found_the_folder_taken_by_a_reader_without_a_reason_waits_for_it(
    tmp_path: Path,
) -> None:
    """Tried: the interleaving a CI run's continuous loader met, started while its test read
    the folder: the reader opened the folder before the owner took the owner lock, the owner's
    open failed, and by the time the owner looked who held the folder the reader had closed
    it, so chdb's bare "Error initializing EmbeddedServer" was all it had. A reader process
    holds the folder for a second; the owner's looks at the holder answer "nobody" at those
    moments. Before, the owner ended with "cannot open embedded ClickHouse at …"; now it
    tries again, waits for the reader and serves the folder."""
    folder = tmp_path / "chdb"
    with holding_process(READER, folder, "open") as reader:
        owner_process = subprocess.Popen(
            [sys.executable, "-c", OWNER_AFTER_A_READER, str(folder)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(1.0)  # the owner meets the reader's folder
            assert reader.stdin is not None
            reader.stdin.close()
            assert reader.wait(timeout=30) == 0
            out, err = owner_process.communicate(timeout=60)
        finally:
            if owner_process.poll() is None:
                owner_process.kill()
                owner_process.wait(timeout=30)
    assert owner_process.returncode == 0, err[-2000:]
    assert out.strip() == "serving"
