"""dev-stats dimension dim_layout_group (spec 003): Kafka layout-group events → ClickHouse.

`loader.load_continuously` loads as events come (`pin devstats load`, the Dagster asset's
long-lived runs); `loader.load_once` runs one bounded cycle (`--once`); `loader.backfill` replays
the topic (inserting all of it, or a LayoutGroupId range: replay.py); `dim` holds the operator
reads and the write, `reads` the scoped reads (an Actor each), `freshness` the loader's lag.

This module is the read side's face: the `Actor`, the doors' base class and the scoped reads that
take one, which is all the read API (`pin_pipelines.api`) may use. Importing any
`pin_pipelines.devstats.x` runs this module, so it must not import the loader, `dim` or the
operator's door: the operator side has its own face, `devstats.loading`
(tests/unit/test_layering.py).
"""

from pin_pipelines.devstats.actor import Actor, ActorDoor
from pin_pipelines.devstats.reads import LayoutGroup, groups, labels, readable

__all__ = [
    "Actor",
    "ActorDoor",
    "LayoutGroup",
    "groups",
    "labels",
    "readable",
]
