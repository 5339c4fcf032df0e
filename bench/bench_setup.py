"""`bin/up` from a fresh clone to the Dagster UI answering: a baseline commit against a candidate,
alternated, each in a clone of its own with services of its own on spare ports (so a `pin stack
up` on the default ports may keep running). Prints ONE JSON line: each try's seconds to the UI
and its phases (bin/up's `[phase]` lines), and the candidate's median over the baseline's.

    .venv/bin/python bench/bench_setup.py --baseline d123f8b [--candidate HEAD] [--pairs 2]

The package caches (pip's, uv's) are what they are on the machine: a fresh clone, not a fresh
machine. Each try is stopped (SIGTERM to bin/up's session, then `pin stack down`) before the next.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import suppress
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_average, log

REPO = Path(__file__).resolve().parent.parent
#: Ports of their own: the tries never meet a `pin stack up` on the defaults.
PORTS = {
    "PIN_PG_DSN": "postgresql://postgres@127.0.0.1:5532/pin",
    "PIN_KAFKA_BOOTSTRAP": "127.0.0.1:9192",
    "PIN_DAGSTER_PORT": "3200",
}
UI_SECONDS = 900.0
PHASE = re.compile(r"^\[phase\] (?!>>>)(.+?)\s+([\d.]+)s$")


def ui_answers() -> bool:
    url = f"http://127.0.0.1:{PORTS['PIN_DAGSTER_PORT']}/server_info"
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def one_try(commit: str, folder: Path) -> dict[str, object]:
    """A clone of `commit` in `folder`, bin/up until the UI answers, then everything stopped."""
    subprocess.run(["git", "clone", "-q", str(REPO), str(folder)], check=True)
    subprocess.run(["git", "-C", str(folder), "checkout", "-q", commit], check=True)
    env = {**os.environ, **PORTS, "PIN_STATE_DIR": str(folder / ".pin")}
    log_path = folder / "up.log"
    started = time.monotonic()
    with log_path.open("w") as out:
        up = subprocess.Popen(
            ["bash", "bin/up"],
            cwd=folder,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    seconds = None
    try:
        while time.monotonic() - started < UI_SECONDS and up.poll() is None:
            if ui_answers():
                seconds = round(time.monotonic() - started, 1)
                break
            time.sleep(0.5)
    finally:
        with suppress(ProcessLookupError):  # bin/up failed: its session may be gone
            os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        subprocess.run(
            [str(folder / ".venv/bin/pin"), "stack", "down"], env=env, capture_output=True
        )
    phases = {
        m.group(1): float(m.group(2))
        for m in map(PHASE.match, log_path.read_text().splitlines())
        if m
    }
    if seconds is None:
        log("no UI", commit=commit, log_tail=log_path.read_text()[-2000:])
    return {"commit": commit, "ui_seconds": seconds, "phases": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the commit to compare against")
    parser.add_argument("--candidate", default="HEAD")
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    commits = {
        role: subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", rev],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for role, rev in (("baseline", args.baseline), ("candidate", args.candidate))
    }
    tries: dict[str, list[dict[str, object]]] = {"baseline": [], "candidate": []}
    root = Path(tempfile.mkdtemp(prefix="bench-setup-"))
    root.chmod(0o711)  # PostgreSQL's OS user goes through it to its data folder
    try:
        for pair in range(args.pairs):
            for role, commit in commits.items():
                result = one_try(commit, root / f"{role}-{pair}")
                log("try", role=role, **result, load=load_average())
                tries[role].append(result)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def median(role: str) -> float | None:
        found = [float(t["ui_seconds"]) for t in tries[role] if t["ui_seconds"] is not None]
        return statistics.median(found) if found else None

    base, cand = median("baseline"), median("candidate")
    print(
        json.dumps(
            {
                "commits": commits,
                "tries": tries,
                "median_ui_seconds": {"baseline": base, "candidate": cand},
                "candidate_over_baseline": round(cand / base, 2) if base and cand else None,
            }
        )
    )


if __name__ == "__main__":
    main()
