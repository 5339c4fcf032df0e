"""How the suite is split over parallel workers (bin/test): modules whole, the longest first.

bin/test runs two lanes: the parallel lane (`-m "not alone"`, pytest-xdist, `--dist loadgroup`)
and then the `alone` lane, one test at a time, for what needs the machine to itself.

In the parallel lane a work unit is a module (its module fixtures start once), or several
modules that share a service they change on purpose: such a module says so with
`pytestmark = pytest.mark.xdist_group("<service>")`, and the modules of one group run one after
another on one worker. xdist hands the units out in collection order (`--no-loadscopereorder`),
so they are ordered here by their measured length, longest first: a long unit started last would
run on alone at the end while the other workers idle. The lengths are `tests/module_seconds.json`,
refreshed from a run's JUnit files by `python -m tests.support.report --write` (a new module
counts as long until measured, so it starts early).
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


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def unit_of(item: pytest.Item) -> str:
    """The work unit of `item`: its module's xdist group, or the module itself."""
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return module_of(item)
    return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in its work unit (xdist's loadgroup then keeps a unit on one worker), the
    units in the order of their measured length, longest first; within a unit the tests keep
    their order. Every worker collects the same order (xdist requires it). Tried first, since
    xdist's own hook reads the groups to name the tests."""
    seconds = module_seconds()
    units: dict[str, set[str]] = {}
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        unit = unit_of(item)
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(unit))
        units.setdefault(unit, set()).add(module_of(item))
        first_seen.setdefault(unit, index)
    length = {
        unit: sum(seconds.get(module, UNMEASURED_SECONDS) for module in modules)
        for unit, modules in units.items()
    }

    def key(item: pytest.Item) -> tuple[float, int]:
        unit = unit_of(item)
        return (-length[unit], first_seen[unit])

    items.sort(key=key)  # stable: a unit's tests keep their order
