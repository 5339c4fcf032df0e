"""When a long-lived run's successor is launched: before the run in flight ends, by the measured
launch latency of its job, so the relay's and the loader's legs have no gap."""

import dagster as dg

from pin_pipelines.quantiles import quantile

#: A long-lived run's successor is launched at least this long before the run in flight ends,
#: and longer when launches are slow: the measured launch latency's p99 plus
#: HANDOVER_SLACK_SECONDS (`handover_seconds`). The successor waits (relay: on the relay lock;
#: loader: beside it, in the consumer group) for the rest. The launch latency does not hold the
#: sensor's own delay (a 5 s interval, evaluated late on a busy daemon): with 20 s, a successor
#: on a machine with every core busy started 0.8 s before its predecessor's end (test_handover).
HANDOVER_SECONDS = 30.0
HANDOVER_SLACK_SECONDS = 10.0
#: At most: the relay's successor waits on the relay lock meanwhile (its lock_timeout is 60 s).
MAX_HANDOVER_SECONDS = 50.0
#: The launches measured: a job's last runs that started.
LAUNCH_SAMPLE_RUNS = 20


def launch_latencies(instance: dg.DagsterInstance, job_name: str) -> list[float]:
    """Seconds from created to started (the daemon's dequeue, the code server's process start,
    the run worker's imports) of the job's last LAUNCH_SAMPLE_RUNS runs that started, sorted.
    Measured under `pin serve` on a busy 2-core machine: 13.7–19 s, beyond the fixed
    20 s margin's reach once the machine is busier."""
    records = instance.get_run_records(
        dg.RunsFilter(job_name=job_name), limit=LAUNCH_SAMPLE_RUNS * 2
    )
    started = [r for r in records if r.start_time is not None][:LAUNCH_SAMPLE_RUNS]
    return sorted(
        max(0.0, float(r.start_time or 0.0) - r.create_timestamp.timestamp()) for r in started
    )


def handover_seconds(latencies: list[float]) -> float:
    """How long before a long-lived run's end its successor is launched: the launch latency's
    p99 plus slack, so the successor is running before the run in flight ends (no gap in the
    relay's or the loader's leg), within [HANDOVER_SECONDS, MAX_HANDOVER_SECONDS]."""
    p99 = quantile(latencies, 0.99) or 0.0
    return min(MAX_HANDOVER_SECONDS, max(HANDOVER_SECONDS, p99 + HANDOVER_SLACK_SECONDS))
