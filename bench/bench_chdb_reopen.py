"""What the embedded engine allows: can a process let go of a chdb folder for another
process and open it again, what an open costs, and what a close gives back. Prints ONE JSON line.

    .venv/bin/python bench/bench_chdb_reopen.py [--cycles 300]

In a fresh temporary folder: a table; another process opening the folder while this one holds it
(refused) and after this one closed it (allowed); then `--cycles` times open, insert one row,
close, in this process, with the open's duration and the process's threads and resident memory
before and after. The answer decides the loader's design (docs/clickhouse.md, "The embedded
engine").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import chdb.session

PROBE = """
import sys, chdb.session
try:
    chdb.session.Session(sys.argv[1]).close()
except Exception:
    sys.exit(3)
"""


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _resident_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _other_process_opens(folder: str) -> bool:
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, folder], capture_output=True, timeout=120, check=False
    )
    return probe.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=300)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="pin-bench-chdb-")
    session = chdb.session.Session(folder)
    session.query("CREATE TABLE t (x UInt64) ENGINE = MergeTree ORDER BY x")
    refused_while_held = not _other_process_opens(folder)
    session.close()
    allowed_after_close = _other_process_opens(folder)

    threads, resident = _threads(), _resident_mb()
    opens: list[float] = []
    for i in range(args.cycles):
        started = time.perf_counter()
        session = chdb.session.Session(folder)
        opens.append(time.perf_counter() - started)
        session.query(f"INSERT INTO t VALUES ({i})")
        session.close()
    opens.sort()
    print(
        json.dumps(
            {
                "bench": "chdb_reopen",
                "chdb": chdb.__version__,
                "other_process_refused_while_held": refused_while_held,
                "other_process_opens_after_close": allowed_after_close,
                "cycles": args.cycles,
                "open_ms_p50": round(opens[len(opens) // 2] * 1000, 1),
                "open_ms_p99": round(opens[int(len(opens) * 0.99)] * 1000, 1),
                "threads_before_after": [threads, _threads()],
                "resident_mb_before_after": [round(resident), round(_resident_mb())],
                "threads_per_cycle": round((_threads() - threads) / args.cycles, 2),
                "resident_mb_per_cycle": round((_resident_mb() - resident) / args.cycles, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
