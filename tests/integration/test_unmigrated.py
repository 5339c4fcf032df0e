"""A database this release has not migrated: every reader and worker says so in one line."""

from __future__ import annotations

import subprocess

import dagster as dg
import pytest

from pin_pipelines.defs.recalc.sensors import recalc_queue_sensor
from pin_pipelines.defs.relay.sensors import outbox_relay_sensor
from pin_pipelines.defs.resources import RESOURCES
from tests.support.recalc import PIN, REPO_ROOT, pin_env

MIGRATE = "run `pin db migrate`"


@pytest.mark.parametrize(
    "command",
    [
        ("recalc", "drain", "--once"),
        ("outbox", "relay", "--once"),
        ("recalc", "request", "--project-id", "00000000-0000-0000-0000-000000000001"),
    ],
    ids=["drain", "relay", "request"],
)
def test_a_worker_on_an_unmigrated_database_ends_in_one_line(
    dagster_db: str, command: tuple[str, ...]
) -> None:
    """Tried: the drain, the relay and a forced recalc on a database that exists and is empty
    (never migrated). Before, each ended with `pin: error: UndefinedTable: relation … does not
    exist`, which names neither the server nor the cause; now one line names both and what to
    run, with a non-zero exit."""
    done = subprocess.run(
        [PIN, *command],
        cwd=REPO_ROOT,
        env=pin_env(dagster_db),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert MIGRATE in lines[0] and "127.0.0.1" in lines[0], lines[0]


@pytest.mark.parametrize("sensor", [outbox_relay_sensor, recalc_queue_sensor], ids=lambda s: s.name)
def test_the_workers_sensors_skip_an_unmigrated_database_in_one_line(
    dagster_db: str, monkeypatch: pytest.MonkeyPatch, sensor: dg.SensorDefinition
) -> None:
    """Tried: the relay's and the drain's sensors evaluated against an empty database. Before,
    the relay's raised UndefinedTable (a traceback on every 5-second tick in the daemon's log);
    now each skips the tick with the reason in one line."""
    monkeypatch.setenv("PIN_PG_DSN", dagster_db)
    with dg.DagsterInstance.ephemeral() as instance:
        result = sensor(dg.build_sensor_context(instance=instance, resources=RESOURCES))
    assert isinstance(result, dg.SkipReason), result
    reason = result.skip_message or ""
    assert MIGRATE in reason and "\n" not in reason, reason
