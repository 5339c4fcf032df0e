"""The embedded ClickHouse folder's owner and its readers (pin_pipelines/clickhouse/embedded.py):
a reader that looks for an owner just before one takes the folder waits for it to answer.

Real chdb in a process of its own, the owner; the reader is this process.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
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


@pytest.fixture
def owning_process(tmp_path: Path) -> Iterator[Path]:
    """A process that owns the folder `tmp_path/chdb` and answers on its socket."""
    folder = tmp_path / "chdb"
    process = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        assert process.stdout.readline().strip() == "serving"
        yield folder
    finally:
        process.stdin.close()
        process.wait(timeout=30)


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
