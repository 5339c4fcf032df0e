"""Scale benchmark and soak; not a test. Prints ONE JSON line (progress on stderr).

Builds a skewed catalogue (default 100,000 projects / 10,000,000 property objects: a few projects
of 50,000 objects, most of about 35) and a 1,000-project baseline with the same size classes, each
in a database of its own, then measures both in the same run:

- recompute p50/p99 per project size (goal: the large database within 1.5x of the baseline);
- drain throughput with 1 and 2 workers on the same mix of projects;
- CPU-seconds per recalculated project by size, per relayed and per loaded event (`pin outbox
  relay --once`, `pin devstats load --once` on a private Kafka broker and embedded ClickHouse);
- `pin reconcile` over the whole catalogue (goal: < 60 s at 10M objects);
- E2E lag under `pin serve` (private Dagster home, storage database and port) at a sustained
  edit rate;
- with --soak MINUTES: the same load on the large catalogue for that long, sampled every minute
  (queue, outbox and counter tables with their indexes, dead tuples, drain throughput).

    .venv/bin/python bench/bench_scale.py [--projects 100000] [--objects 10000000]
        [--baseline-projects 1000] [--edit-rate 20] [--e2e-minutes 5] [--soak 30]
        [--only-soak]

The databases (--database, default pin_bench_scale, and its *_baseline / *_dagster siblings on
the PIN_PG_DSN server) are dropped at the end; the broker and the Dagster processes are stopped
and waited for. The PIN_PG_DSN role must be a superuser: the loader turns the raisers off with
session_replication_role and checkpoints after the load. CPU figures need the server on this
machine (bench/_cpu.py reads /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_average
from scale.build import build_catalogues
from scale.catalogue import baseline_shape, catalogue_shape
from scale.databases import cpu_meter, create_databases
from scale.events import measure_events
from scale.recompute import measure_recalc
from scale.serve import measure_e2e, under_load
from scale.services import Private


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (`--help` prints them under this module's docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--projects", type=int, default=100_000)
    parser.add_argument("--objects", type=int, default=10_000_000)
    parser.add_argument(
        "--largest", type=int, default=50_000, help="objects of the biggest projects"
    )
    parser.add_argument("--baseline-projects", type=int, default=1_000)
    parser.add_argument(
        "--samples", type=int, default=200, help="recomputes per size class and database"
    )
    parser.add_argument("--distinct", type=int, default=20, help="projects per size class")
    parser.add_argument("--rounds", type=int, default=3, help="drain throughput rounds")
    parser.add_argument(
        "--events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="relay, load and reconcile on a private broker",
    )
    parser.add_argument("--edit-rate", type=float, default=20.0, help="edits/s under pin serve")
    parser.add_argument("--e2e-minutes", type=float, default=5.0, help="0: no pin serve phase")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of load not measured")
    parser.add_argument("--soak", type=float, default=0.0, metavar="MINUTES")
    parser.add_argument(
        "--database",
        default="pin_bench_scale",
        help="name of the large catalogue's database; the others get suffixes",
    )
    parser.add_argument(
        "--only-soak",
        action="store_true",
        help="build the large catalogue and soak it; no other measure",
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    # A SIGTERM (a stopped nohup run) unwinds like an error: databases dropped, broker and
    # `pin serve` stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    large_shape = catalogue_shape(args.projects, args.objects, args.largest)
    shapes = {"large": large_shape}
    if not args.only_soak:
        shapes["baseline"] = baseline_shape(large_shape, args.baseline_projects)
    names = {"large": args.database, "baseline": f"{args.database}_baseline"}
    result: dict[str, Any] = {
        "bench": "scale",
        "machine": {"cpus": os.cpu_count(), "load_average_start": load_average()},
        "catalogues": {label: shape.as_dict() for label, shape in shapes.items()},
    }
    with ExitStack() as stack:
        # The seeding phase: the baseline's database first, each dropped at the end.
        dsns = create_databases(stack, names, [x for x in ("baseline", "large") if x in shapes])
        classes, built = build_catalogues(dsns, shapes)
        for label, report in built.items():
            result["catalogues"][label].update(report)
        meter = cpu_meter(dsns, names)
        private = Private(stack)
        if not args.only_soak:
            result.update(
                measure_recalc(dsns, classes, meter, args.samples, args.distinct, args.rounds)
            )
            if args.events:
                result["events_and_reconcile"] = measure_events(dsns, shapes, private, meter)
            if args.e2e_minutes > 0:
                result["e2e_under_pin_serve"] = measure_e2e(
                    dsns, private, meter, args.edit_rate, args.e2e_minutes, args.warmup
                )
        if args.soak > 0:
            result["soak"] = under_load(
                dsns["large"],
                "large",
                private,
                meter,
                args.edit_rate,
                args.soak,
                0.0,
                per_minute=True,
            )
        result["machine"]["load_average_end"] = load_average()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
