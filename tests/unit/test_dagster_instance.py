"""The Dagster instance `pin serve` installs (pin_pipelines/dagster_instance.py) runs the daemons
the project uses and no other (issue 48: each daemon loops all day against the storage, a
connection per statement), and the project uses none of those it turns off: an automation
condition, a freshness policy or a run-retry tag added later fails here until its daemon is on."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import yaml
from dagster._core.storage.tags import MAX_RETRIES_TAG
from dagster._daemon.asset_daemon import AssetDaemon
from dagster._daemon.auto_run_reexecution.event_log_consumer import EventLogConsumerDaemon
from dagster._daemon.daemon import BackfillDaemon, MonitoringDaemon, SchedulerDaemon, SensorDaemon
from dagster._daemon.freshness import FreshnessDaemon
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import (
    QueuedRunCoordinatorDaemon,
)

from pin_pipelines.config import Settings
from pin_pipelines.dagster_instance import write_instance_yaml
from pin_pipelines.definitions import defs

#: Sensors and schedules launch every run; the run queue holds the tag limits; run monitoring
#: fails a run whose worker died; Dagster runs the backfill daemon whatever the file says.
USED = {
    SensorDaemon.daemon_type(),
    SchedulerDaemon.daemon_type(),
    QueuedRunCoordinatorDaemon.daemon_type(),
    MonitoringDaemon.daemon_type(),
    BackfillDaemon.daemon_type(),
}


def installed_daemons(home: Path) -> set[str]:
    """The daemons `dagster-daemon run` starts on the instance `pin serve` installs in `home`
    (its storage on SQLite here: the daemons depend on the rest of the file)."""
    write_instance_yaml(Settings.from_env({}), home / "dagster.yaml")
    config = yaml.safe_load((home / "dagster.yaml").read_text())
    config["storage"] = {"sqlite": {"base_dir": str(home / "storage")}}
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    with dg.DagsterInstance.from_config(str(home)) as instance:
        return set(instance.get_required_daemon_types())


def test_the_installed_instance_runs_only_the_daemons_the_project_uses(tmp_path: Path) -> None:
    assert installed_daemons(tmp_path) == USED


def test_nothing_needs_the_daemons_turned_off() -> None:
    """The run-retry daemon (EventLogConsumerDaemon) retries only runs tagged with a retry count,
    the asset daemon evaluates automation conditions, the freshness daemon freshness policies."""
    turned_off = {
        EventLogConsumerDaemon.daemon_type(),
        AssetDaemon.daemon_type(),
        FreshnessDaemon.daemon_type(),
    }
    assert not turned_off & USED
    graph = defs.get_repository_def().asset_graph
    nodes = [graph.get(key) for key in graph.get_all_asset_keys()]
    assert [n.key for n in nodes if n.automation_condition is not None] == []
    assert [n.key for n in nodes if n.freshness_policy_or_from_metadata is not None] == []
    jobs = defs.get_repository_def().get_all_jobs()
    assert [job.name for job in jobs if MAX_RETRIES_TAG in job.tags] == []
