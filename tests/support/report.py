"""The test run's report from its lanes' JUnit files (bin/test prints it): each lane's tests and
summed test time, the slowest modules and tests; `--write` refreshes tests/module_seconds.json,
the order tests/support/lanes.py hands modules out in.

    python -m tests.support.report [--write] LANE.xml ...
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tests.support.lanes import MODULE_SECONDS

ROOT = Path(__file__).resolve().parents[2]
SLOWEST = 15


@dataclass(frozen=True)
class Case:
    module: str
    name: str
    seconds: float
    outcome: str


def module_path(classname: str) -> str:
    """`tests.integration.test_x` or `tests.integration.test_x.Class` → the module's path."""
    parts = [part for part in classname.split(".") if part]
    for end in range(len(parts), 0, -1):
        path = Path(*parts[:end]).with_suffix(".py")
        if (ROOT / path).exists():
            return path.as_posix()
    return classname


def cases(junit: Path) -> list[Case]:
    found = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        found.append(
            Case(
                module_path(case.get("classname") or ""),
                case.get("name", "").split("@", 1)[0],  # xdist's group suffix
                float(case.get("time", "0")),
                outcome,
            )
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="refresh tests/module_seconds.json")
    parser.add_argument("junit", nargs="+", type=Path)
    args = parser.parse_args()
    everything: list[Case] = []
    for junit in args.junit:
        if not junit.exists():
            print(f"[report] {junit.stem}: no report (the lane did not run)")
            continue
        lane = cases(junit)
        everything += lane
        outcomes = defaultdict(int)
        for case in lane:
            outcomes[case.outcome] += 1
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
        total = sum(c.seconds for c in lane)
        print(f"[report] lane {junit.stem}: {counts or 'no tests'}; {total:.0f}s of test time")
    per_module: dict[str, float] = defaultdict(float)
    for case in everything:
        per_module[case.module] += case.seconds
    print("[report] slowest modules (test time, all lanes):")
    for module, seconds in sorted(per_module.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        print(f"[report]   {seconds:7.1f}s  {module}")
    print("[report] slowest tests:")
    for case in sorted(everything, key=lambda c: -c.seconds)[:SLOWEST]:
        print(f"[report]   {case.seconds:7.1f}s  {case.module}::{case.name}")
    if args.write and per_module:
        MODULE_SECONDS.write_text(
            json.dumps({m: round(s, 1) for m, s in sorted(per_module.items())}, indent=1) + "\n"
        )
        print(f"[report] wrote {MODULE_SECONDS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
