"""PIN_RECALC_MAX_DRAIN_RUNS is one knob: the Dagster instance that `pin serve`
installs admits that many concurrent recalc_drain_job runs, and the sensor launches no more.

The run queue is Dagster's own QueuedRunCoordinator daemon, run in process for two iterations on
an instance made of the installed dagster.yaml's `run_coordinator` and `concurrency` sections.
Its storage is a temporary SQLite one and its run launcher Dagster's MockedRunLauncher (records
the launch, starts no process): neither takes part in the limits.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest
import yaml
from dagster._core.remote_origin import (
    InProcessCodeLocationOrigin,
    RemoteJobOrigin,
    RemoteRepositoryOrigin,
)
from dagster._core.test_utils import create_test_daemon_workspace_context
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.workspace.load_target import EmptyWorkspaceTarget
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import (
    QueuedRunCoordinatorDaemon,
)

from pin_pipelines.config import Settings
from pin_pipelines.dagster_instance import TEMPLATE
from pin_pipelines.defs.recalc.jobs import recalc_drain_job
from pin_pipelines.defs.recalc.sensors import recalc_queue_sensor
from pin_pipelines.defs.relay.jobs import outbox_relay_job
from pin_pipelines.defs.resources import RESOURCES
from pin_pipelines.errors import PinError
from pin_pipelines.run_tags import DRAIN_JOB_TAGS
from pin_pipelines.serve import prepare_dagster_home
from tests.support.chessboard import make_building, make_project

#: Where workspace.yaml loads the definitions from: the origin the daemon sees on a queued run.
LOCATION = InProcessCodeLocationOrigin(
    LoadableTargetOrigin(module_name="pin_pipelines.definitions", attribute="defs"),
    location_name="pin_pipelines",
)


def installed_instance_yaml(pg_dsn: str, home: Path, env: dict[str, str]) -> dict[str, Any]:
    """What `pin serve` writes to DAGSTER_HOME with these settings, parsed."""
    prepare_dagster_home(
        Settings.from_env({"PIN_PG_DSN": pg_dsn, "DAGSTER_HOME": str(home), **env})
    )
    installed: dict[str, Any] = yaml.safe_load((home / "dagster.yaml").read_text())
    return installed


def queue(instance: dg.DagsterInstance, job: dg.JobDefinition, count: int) -> None:
    """`count` queued runs of `job` carrying its run tags, as the sensor's RunRequests do."""
    origin = RemoteJobOrigin(RemoteRepositoryOrigin(LOCATION, "__repository__"), job.name)
    for _ in range(count):
        instance.create_run_for_job(
            job_def=job,
            remote_job_origin=origin,
            status=dg.DagsterRunStatus.QUEUED,
            tags=job.run_tags,
        )


def dequeue(instance: dg.DagsterInstance) -> Counter[tuple[str, dg.DagsterRunStatus]]:
    """Two iterations of the run-queue daemon; (job, status) of every run afterwards."""
    with (
        create_test_daemon_workspace_context(EmptyWorkspaceTarget(), instance) as workspace,
        QueuedRunCoordinatorDaemon(interval_seconds=1) as daemon,
    ):
        for _ in range(2):
            list(daemon.run_iteration(workspace))
    return Counter((run.job_name, run.status) for run in instance.get_runs())


@pytest.mark.parametrize(("env", "limit"), [({}, 2), ({"PIN_RECALC_MAX_DRAIN_RUNS": "3"}, 3)])
def test_the_run_queue_admits_as_many_drain_runs_as_the_setting(
    pg_dsn: str, tmp_path: Path, env: dict[str, str], limit: int
) -> None:
    """`pin serve`'s DAGSTER_HOME prepared without the setting and with 3. Tried: limit + 2
    drain runs and three outbox relay runs queued, two passes of the run-queue daemon. Exactly
    `limit` drain runs start (2 by default: the setting's default, since dagster.yaml holds no
    drain limit of its own) and two relay runs (its own limit, a run and its successor, is
    untouched); the rest stay queued."""
    installed = installed_instance_yaml(pg_dsn, tmp_path / "home", env)
    config = {key: installed[key] for key in ("run_coordinator", "concurrency")}
    with dg.instance_for_test(
        overrides={
            **config,
            "run_launcher": {"module": "dagster._core.test_utils", "class": "MockedRunLauncher"},
        }
    ) as instance:
        queue(instance, recalc_drain_job, limit + 2)
        queue(instance, outbox_relay_job, 3)
        started, queued = dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.QUEUED
        assert dequeue(instance) == {
            (recalc_drain_job.name, started): limit,
            (recalc_drain_job.name, queued): 2,
            (outbox_relay_job.name, started): 2,  # a run and its successor (hand-over)
            (outbox_relay_job.name, queued): 1,
        }


def test_the_repository_dagster_yaml_leaves_the_drain_limit_to_the_setting() -> None:
    """A drain entry in the repository's dagster.yaml would be a second value for the knob (and
    the one a plain `dagster dev` reading ./dagster.yaml would use)."""
    template = yaml.safe_load(TEMPLATE.read_text())
    limits = template["concurrency"]["runs"]["tag_concurrency_limits"]
    drain_tags = set(DRAIN_JOB_TAGS.items())
    assert [entry for entry in limits if (entry["key"], entry.get("value")) in drain_tags] == []


def test_the_sensor_launches_up_to_the_same_number(
    db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PIN_RECALC_MAX_DRAIN_RUNS=3 and a queue row overdue by 30 s (the backlog case, in which
    the sensor adds runs while others are in flight). Tried: the sensor with 0, 1, 2 and 3
    drain runs in flight. It asks for a run up to 2 and skips at 3."""
    monkeypatch.setenv("PIN_RECALC_MAX_DRAIN_RUNS", "3")
    make_building(db, make_project(db))  # its trigger queues the project
    db.execute(
        "UPDATE chessboard.project_recalc_requests SET due_at = now() - interval '30 seconds'"
    )
    with dg.DagsterInstance.ephemeral() as instance:
        for in_flight in range(4):
            result = recalc_queue_sensor(
                dg.build_sensor_context(instance=instance, resources=RESOURCES)
            )
            expected = dg.RunRequest if in_flight < 3 else dg.SkipReason
            assert isinstance(result, expected), (in_flight, result)
            instance.create_run_for_job(
                job_def=recalc_drain_job, status=dg.DagsterRunStatus.STARTED
            )


@pytest.mark.parametrize("value", ["0", "-1", "two", "2.5"])
def test_a_bad_setting_is_refused_in_one_line(value: str) -> None:
    with pytest.raises(PinError, match=r"^PIN_RECALC_MAX_DRAIN_RUNS must be .*got"):
        Settings.from_env({"PIN_RECALC_MAX_DRAIN_RUNS": value})
