"""The `dagster.yaml` that `pin serve` and `pin dev` install in DAGSTER_HOME: the repository's
dagster.yaml plus the run-queue limit that a setting owns.

PIN_RECALC_MAX_DRAIN_RUNS caps concurrent drain runs twice: the sensor launches no more, and the
QueuedRunCoordinator's tag limit admits no more (runs launched by hand from the UI included).
PIN_DEVSTATS_MAX_LOAD_RUNS caps the dim_layout_group loads the same way, plus one: the successor
of a long-lived load run starts shortly before that run ends.
Dagster reads a tag limit as a plain integer (no `env:` source, unlike the storage URL), so the
limit is written into the installed copy from the setting; the repository file holds none, which
would be a second value for the same knob.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pin_pipelines.config import SOURCE_ROOT, Settings
from pin_pipelines.run_tags import DEVSTATS_JOB_TAGS, DRAIN_JOB_TAGS

TEMPLATE = SOURCE_ROOT / "dagster.yaml"

HEADER = (
    f"# Written by `pin serve` / `pin dev` from {TEMPLATE}, PIN_RECALC_MAX_DRAIN_RUNS and\n"
    "# PIN_DEVSTATS_MAX_LOAD_RUNS;\n"
    "# edit those instead: this file is rewritten at each start.\n"
)


def instance_config(settings: Settings) -> dict[str, Any]:
    """The repository's dagster.yaml with the drain and load runs' tag limits from the settings."""
    config: dict[str, Any] = yaml.safe_load(TEMPLATE.read_text())
    runs = config["concurrency"]["runs"]
    runs["tag_concurrency_limits"] = [
        *(runs.get("tag_concurrency_limits") or []),
        *(
            {"key": key, "value": value, "limit": limit}
            for tags, limit in (
                (DRAIN_JOB_TAGS, settings.recalc_max_drain_runs),
                # + 1: a load run's successor starts before the run ends (the hand-over).
                (DEVSTATS_JOB_TAGS, settings.devstats_max_load_runs + 1),
            )
            for key, value in tags.items()
        ),
    ]
    return config


def write_instance_yaml(settings: Settings, target: Path) -> None:
    """Install `instance_config` at `target` (comments are not kept: the header says where the
    commented original is)."""
    target.write_text(HEADER + yaml.safe_dump(instance_config(settings), sort_keys=False))
