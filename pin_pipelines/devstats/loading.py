"""The operator side's face of devstats: the loader (`load_once`, `load_continuously`,
`backfill`) and its options and summary, the loader group's place in its topic and freshness,
the operator's Actor, the dimension's description and its operator queries, for the Dagster
wiring, `pin`, the reconciliation and the exporter.

Why not in `devstats/__init__`: importing any `pin_pipelines.devstats.x` runs the package's
`__init__`, so an `__init__` that imported the loader side would hand it to the read API
(`pin_pipelines.api`) through its `Actor` and reads. The API may never reach this module
(OPERATOR_SIDE in tests/unit/test_layering.py); the package's `__init__` is the read side's face.
"""

from pin_pipelines.devstats.dim import QUERIES as DIM_QUERIES
from pin_pipelines.devstats.dimension import DIM_LAYOUT_GROUP
from pin_pipelines.devstats.freshness import FRESHNESS_SLA_SECONDS, ConsumerLag, unloaded_events
from pin_pipelines.devstats.loader import (
    LoadOptions,
    LoadSummary,
    backfill,
    load_continuously,
    load_once,
)
from pin_pipelines.devstats.offsets import (
    DEFAULT_GROUP,
    committed_offsets,
    kafka_consumer,
    topic_partitions,
    watermarks,
)
from pin_pipelines.devstats.operator import operator_actor
from pin_pipelines.devstats.replay import IdRange

__all__ = [
    "DEFAULT_GROUP",
    "DIM_LAYOUT_GROUP",
    "DIM_QUERIES",
    "FRESHNESS_SLA_SECONDS",
    "ConsumerLag",
    "IdRange",
    "LoadOptions",
    "LoadSummary",
    "backfill",
    "committed_offsets",
    "kafka_consumer",
    "load_continuously",
    "load_once",
    "operator_actor",
    "topic_partitions",
    "unloaded_events",
    "watermarks",
]
