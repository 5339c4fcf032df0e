"""How the suite is split over parallel workers (bin/test): work units whole, the longest first.

bin/test runs two lanes: the parallel lane (`-m "not alone"`, pytest-xdist, `--dist loadfile`)
and then the `alone` lane, one test at a time, for what needs the machine to itself.

In the parallel lane a work unit is a module (its module fixtures start once), or several
modules that share a service they change on purpose: such a module says so with
`pytestmark = pytest.mark.xdist_group("<service>")` at its top level, and the modules of one
group run one after another on one worker. xdist's own `loadgroup` cannot do this under pytest 9
(it renames a test through `Item._nodeid`, which pytest 9 no longer reads), so the scheduler here
takes the group from the module's source, which the controller can read without collecting.

Units are handed out in collection order (`--no-loadscope-reorder`), and they are ordered here by
their measured length, longest first: a long unit started last would run on alone at the end
while the other workers idle. The lengths are `tests/module_seconds.json`, refreshed from a run's
JUnit files by `python -m tests.support.report --write` (a new module counts as long until
measured, so it starts early).
"""

from __future__ import annotations

import ast
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE_SECONDS = ROOT / "tests" / "module_seconds.json"
#: A module not measured yet is taken as this long: early in the order, never last.
UNMEASURED_SECONDS = 120.0


def module_seconds() -> dict[str, float]:
    """The measured length of each module (its path from the repository root)."""
    try:
        return {str(k): float(v) for k, v in json.loads(MODULE_SECONDS.read_text()).items()}
    except FileNotFoundError:
        return {}


@cache
def declared_group(module: str) -> str | None:
    """The group `module` declares: `pytestmark = pytest.mark.xdist_group("name")`."""
    try:
        tree = ast.parse((ROOT / module).read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            for call in ast.walk(node.value):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "xdist_group"
                    and call.args
                    and isinstance(call.args[0], ast.Constant)
                ):
                    return str(call.args[0].value)
    return None


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its module's group, or its module."""
    module = nodeid.split("::", 1)[0]
    return declared_group(module) or module


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The units in the order of their measured length, longest first; within a unit the tests
    keep their order. Every worker collects the same order (xdist requires it)."""
    seconds = module_seconds()
    units: dict[str, set[str]] = {}
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        unit = unit_of(item.nodeid)
        units.setdefault(unit, set()).add(item.nodeid.split("::", 1)[0])
        first_seen.setdefault(unit, index)
    length = {
        unit: sum(seconds.get(module, UNMEASURED_SECONDS) for module in modules)
        for unit, modules in units.items()
    }

    def key(item: pytest.Item) -> tuple[float, int]:
        unit = unit_of(item.nodeid)
        return (-length[unit], first_seen[unit])

    items.sort(key=key)  # stable: a unit's tests keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` by work unit (a module, or a group of modules) instead of by file."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)
