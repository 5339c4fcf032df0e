"""A ClickHouse migration as a later release would ship it, and a continuous load it is applied
under (on any ClickHouse path): tests/integration/test_clickhouse_migrations.py and, for the
cluster, test_clickhouse_cluster.py."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pin_pipelines.clickhouse import ClickHouse, migrate_clickhouse, open_clickhouse
from pin_pipelines.clickhouse.sqlfiles import CLICKHOUSE_MIGRATIONS_DIR
from pin_pipelines.devstats.loader import LoadOptions
from tests.support.devstats import Group, produce_events
from tests.support.loaders import loaders, versions, wait_for

#: A column with a default, and a setting changed (18.16 has neither MODIFY SETTING nor this
#: setting: legacy.py makes that statement nothing there).
ADD_NOTE = """-- A note on each layout group.
ALTER TABLE pin_dev_stats.dim_layout_group ADD COLUMN Note String DEFAULT 'none';
ALTER TABLE pin_dev_stats.dim_layout_group
    MODIFY SETTING non_replicated_deduplication_window = 2000;
"""


def with_migration(folder: Path, version: str, text: str) -> Path:
    """The shipped migrations and one more, `version`.sql, in `folder` (made here)."""
    folder.mkdir()
    for path in CLICKHOUSE_MIGRATIONS_DIR.glob("*.sql"):
        shutil.copy(path, folder)
    (folder / f"{version}.sql").write_text(text)
    return folder


def migrate_while_loading(
    url: str,
    cluster: str | None,
    migrations: Path,
    options: LoadOptions,
    env: dict[str, str],
    bootstrap: str,
    logs: Path,
    inspect: Callable[[ClickHouse], Any],
) -> dict[str, Any]:
    """A continuous `pin devstats load` process (env: `loader_env`) loads 300 groups' versions
    1–10 in three waves; the migrations of `migrations` are applied while the second wave loads
    (on the embedded engine through the loader, which owns the folder). Waits until every group
    is at version 10, then gives `inspect` a client while the loader still runs (this process
    may hold another embedded folder, and chdb opens one per process: the loader answers for
    its own). The loader's summary, what the migration applied under "applied", and what
    `inspect` returned under "inspected"."""
    groups = [Group() for _ in range(300)]
    applied: list[str] = []
    with loaders(options, env, logs) as start:
        loader = start("loader")
        for wave, new in enumerate((range(1, 4), range(4, 8), range(8, 11))):
            produce_events(bootstrap, options.topic, [g.event(v) for v in new for g in groups])
            if wave == 0:
                # The loader owns an embedded folder once it has loaded: a client opened before
                # that would open the folder itself, which this process may not (it may hold
                # another folder; a CI run failed so).
                wait_for(
                    "the first wave loaded",
                    lambda: versions(url, groups) == {g.id: 3 for g in groups},
                    120,
                )
            if wave == 1:
                with open_clickhouse(url) as ch:
                    applied = migrate_clickhouse(ch, cluster, migrations=migrations)
        wait_for(
            "every group at version 10",
            lambda: versions(url, groups) == {g.id: 10 for g in groups},
            120,
        )
        with open_clickhouse(url) as ch:
            inspected = inspect(ch)
        report, _ = loader.stop()
    return {**report, "applied": applied, "inspected": inspected}
