"""How the suite is split over parallel workers (bin/test): modules whole, the longest first.

bin/test runs two lanes: the parallel lane (`-m "not alone"`, pytest-xdist, `--dist loadfile`:
a module stays on one worker, so its module fixtures start once) and then the `alone` lane, one
test at a time, for what needs the machine to itself. xdist hands modules out in collection order
(`--no-loadscopereorder`), so the modules are ordered here by their measured length, longest
first: a long module started last would run on alone at the end while the other workers idle.
The lengths are `tests/module_seconds.json`, refreshed from a run's JUnit files by `python -m
tests.support.report --write` (a new module counts as long until measured, so it starts early).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

MODULE_SECONDS = Path(__file__).resolve().parents[1] / "module_seconds.json"
#: A module not measured yet is taken as this long: early in the order, never last.
UNMEASURED_SECONDS = 120.0


def module_seconds() -> dict[str, float]:
    """The measured length of each module (its path from the repository root)."""
    try:
        return {str(k): float(v) for k, v in json.loads(MODULE_SECONDS.read_text()).items()}
    except FileNotFoundError:
        return {}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules in the order of their measured length, longest first; within a module the
    tests keep their order. Every worker collects the same order (xdist requires it)."""
    seconds = module_seconds()
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::", 1)[0], index)

    def key(item: pytest.Item) -> tuple[float, int]:
        module = item.nodeid.split("::", 1)[0]
        return (-seconds.get(module, UNMEASURED_SECONDS), first_seen[module])

    items.sort(key=key)  # stable: a module's tests keep their order
