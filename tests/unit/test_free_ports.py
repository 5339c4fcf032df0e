"""Private servers' ports (stack/process.py): outside the kernel's ephemeral range, never twice."""

from __future__ import annotations

from pin_pipelines.stack.process import EPHEMERAL_RANGE, free_port, free_port_run


def test_ports_come_from_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    """Tried: 200 single ports and 20 runs of 24. Each lies below the kernel's ephemeral range
    (where an outgoing connection could take a restarted server's port), and no port is handed
    out twice, which random choice alone would do within a few dozen calls."""
    ephemeral_from = int(EPHEMERAL_RANGE.read_text().split()[0])
    singles = [free_port() for _ in range(200)]
    runs = [range(base, base + 24) for base in (free_port_run(24) for _ in range(20))]
    handed_out = singles + [port for run in runs for port in run]
    assert len(set(handed_out)) == len(handed_out)
    assert max(handed_out) < ephemeral_from
