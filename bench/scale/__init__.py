"""The phases of bench/bench_scale.py, one module each, run by that script in turn:

- catalogue: the catalogues' shape (projects per size class);
- build: the bulk build of each catalogue and its consistency checks (seeding);
- recompute: recompute latency by size, drain throughput, CPU per project (the recalc phase);
- events: relay, load and `pin reconcile` on the private services (services);
- serve: E2E lag under `pin serve` with the edit load (edits), and the soak's load;
- soak: the pipeline's samples under load and the soak's verdict;
- databases: the run's databases, their named queries and the CPU meter of their processes.

Each phase takes what it works on as arguments and returns its part of the report: no module
keeps state. Imported with bench/ on sys.path (bench/bench_scale.py puts it there), as
bench/_common.py and bench/_cpu.py are.
"""
