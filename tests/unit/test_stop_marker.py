"""`pin serve`'s clean stop is a marker in DAGSTER_HOME (defs/stopping.py): while it exists every
sensor and every schedule of the code location launches nothing. Checked on the definitions
themselves, with no service running: the sensors see the marker before they read anything."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from pin_pipelines.definitions import defs
from pin_pipelines.defs.stopping import STOPPING_MARKER, STOPPING_REASON


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test(temp_dir=str(tmp_path)) as test_instance:
        yield test_instance


def _stopping(instance: dg.DagsterInstance) -> None:
    (Path(instance.root_directory) / STOPPING_MARKER).touch()


def test_every_sensor_launches_nothing_while_pin_serve_stops(
    instance: dg.DagsterInstance,
) -> None:
    """Tried: each sensor evaluated once with the marker present (services unreachable: the
    unit tests point every address at port 1). Each skips without a run request, saying why."""
    _stopping(instance)
    repository = defs.get_repository_def()
    sensors = repository.sensor_defs
    assert sensors
    for sensor in sensors:
        context = dg.build_sensor_context(
            instance=instance, resources=repository.get_top_level_resources()
        )
        result = sensor.evaluate_tick(context)
        assert result.run_requests == [], sensor.name
        assert result.skip_message == STOPPING_REASON, sensor.name


def test_every_schedule_launches_nothing_while_pin_serve_stops_and_runs_otherwise(
    instance: dg.DagsterInstance,
) -> None:
    """Tried: each schedule evaluated without and then with the marker. Without it each asks
    for its run; with it none does."""
    schedules = defs.get_repository_def().schedule_defs
    assert schedules
    for schedule in schedules:
        context = dg.build_schedule_context(instance=instance)
        assert len(schedule.evaluate_tick(context).run_requests or []) == 1, schedule.name
    _stopping(instance)
    for schedule in schedules:
        context = dg.build_schedule_context(instance=instance)
        assert not schedule.evaluate_tick(context).run_requests, schedule.name
