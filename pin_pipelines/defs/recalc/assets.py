"""The lineage's left end: the source tables and the aggregates the drain keeps right."""

import dagster as dg

from pin_pipelines.defs.resources import CHESSBOARD_AGGREGATES

chessboard_sources = [
    dg.AssetSpec(
        key=["chessboard", table],
        description=f"chessboard.{table} in PostgreSQL, written by the chessboard API.",
        group_name="chessboard",
        kinds={"postgres"},
    )
    for table in ("property_objects", "layouts", "buildings")
]

chessboard_aggregates = dg.AssetSpec(
    key=CHESSBOARD_AGGREGATES,
    description=(
        "Denormalized counters and price/area bounds of projects, buildings, layouts and layout "
        "groups (spec 000). Recomputed per project by recalc_drain_job; each run that changed "
        "anything records a materialization with its counts."
    ),
    deps=[spec.key for spec in chessboard_sources],
    group_name="chessboard",
    kinds={"postgres"},
)
