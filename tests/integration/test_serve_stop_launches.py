"""Every stop of `pin serve` clean, also for runs that are launching when it comes (CONTRACT §9:
however `pin serve` is stopped, no run it launched ends FAILURE).

A CI run saw `pin serve` stopped just as its two check schedules (both fire on the same minute)
had submitted their runs: both ended FAILURE ("marked as failed from outside the execution
context"). The stop canceled the runs queued once, at its start, then waited only for the runs
already launched: a run submitted by a tick evaluated just before the stop, or one the daemon was
dequeuing while it was canceled, was launched on a daemon and code server being stopped.

The Kafka broker is the session's private one (tests/support/private_kafka.py): each start's load
run joins the loader's consumer group, which on the shared broker other `pin serve`s use."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import dagster as dg
import pytest
from dagster_graphql import DagsterGraphQLClient

from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import wait_until
from tests.support.serve import kill_session, migrated_instance, start_serve, submit_run

#: Alone on the machine: 20 stops at random moments, each bounded (STOP_SECONDS); other workers'
#: load would move the moments it means to hit.
pytestmark = pytest.mark.alone

#: The jobs of the check schedules the CI run saw fail, submitted as their schedules submit them.
CHECK_JOBS = ("recalc_poison_check_job", "dim_layout_group_versions_check_job")
#: The stop comes this long after the submissions, at random: before the daemon dequeues them,
#: while they launch, while their checks run, after they ended.
LAUNCH_WINDOW_SECONDS = 8.0
#: A run submitted this long after the stop, at random: a schedule's tick in flight.
TICK_IN_FLIGHT_SECONDS = 1.0
#: Stops of each variant, 20 in all (PIN_TEST_SERVE_STOPS to try more): a start, the launches
#: and a stop take 15-20 s on a 2-core machine.
STOPS_PER_VARIANT = 10
#: A stop ends each run or cancels it within its wind-down bound and the children's grace.
STOP_SECONDS = 40.0
#: How an operator's tools stop it: SIGTERM to its process group (`kill -TERM -<pgid>`, Ctrl-C's
#: shape), and Kubernetes' SIGTERM to its pid alone.
VARIANTS = {"kill-group": "group", "kubernetes": "pid"}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_stop_around_launches_leaves_no_failed_run(
    variant: str,
    pg_dsn: str,
    dagster_db: str,
    kafka: LocalKafka,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tried: STOPS_PER_VARIANT times (PIN_TEST_SERVE_STOPS), `pin serve` started on its own
    instance, both check jobs submitted as their schedules submit them, and the stop sent at a
    random moment within
    LAUNCH_WINDOW_SECONDS after (queued, launching, running or ended), and one more submitted
    within TICK_IN_FLIGHT_SECONDS after the stop (a tick in flight). Before, the stop canceled
    the queued runs once and waited only for launched ones: a run dequeued meanwhile was left
    launching on a stopped daemon (FAILURE, or never ending). Now every run of the instance has
    ended SUCCESS or CANCELED, and every stop exits 0 within its bound."""
    env = migrated_instance(
        pg_dsn=pg_dsn,
        dagster_db=dagster_db,
        kafka_bootstrap=kafka.settings.kafka_bootstrap,
        tmp_path=tmp_path,
    )
    home = Path(env["DAGSTER_HOME"])
    client = DagsterGraphQLClient("127.0.0.1", port_number=int(env["PIN_DAGSTER_PORT"]))
    rng = random.Random(os.environ.get("PIN_TEST_SEED"))
    exits = []
    stops = int(os.environ.get("PIN_TEST_SERVE_STOPS") or STOPS_PER_VARIANT)
    for stop in range(stops):
        log = tmp_path / f"serve-{stop}.log"
        serve = start_serve(env, log)
        try:
            for job in CHECK_JOBS:
                wait_until(
                    lambda job=job: submit_run(client, job), timeout=120, what=f"a {job} run"
                )
            # The stop's moment, at random around the launches (not a wait for a condition).
            time.sleep(rng.uniform(0, LAUNCH_WINDOW_SECONDS))
            if VARIANTS[variant] == "group":
                os.killpg(serve.pid, signal.SIGTERM)
            else:
                serve.send_signal(signal.SIGTERM)
            # A tick evaluated just before the stop submits its run just after it.
            time.sleep(rng.uniform(0, TICK_IN_FLIGHT_SECONDS))
            submit_run(client, CHECK_JOBS[0])  # refused once the webserver is stopping: no run
            serve.wait(timeout=STOP_SECONDS)
            exits.append((serve.returncode, log.read_text()[-2000:]))
        finally:
            kill_session(serve.pid)
            serve.wait(timeout=30)
    monkeypatch.setenv("PIN_DAGSTER_PG_URL", env["PIN_DAGSTER_PG_URL"])
    with dg.DagsterInstance.from_config(str(home)) as instance:
        runs = [r.dagster_run for r in instance.get_run_records()]
    assert [(code, stderr) for code, stderr in exits if code != 0] == []
    submitted = [run for run in runs if run.job_name in CHECK_JOBS]
    # At least: a check schedule whose minute came during a start submitted its own run too.
    assert len(submitted) >= stops * len(CHECK_JOBS)
    assert [
        (run.job_name, run.status)
        for run in runs
        if run.status not in (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.CANCELED)
    ] == []
