"""The reconciliation assets: each materialization re-checks its target and records what drifted;
with `repair: true` in the launchpad it also sends the drift back through the normal pipeline.

The asset check is evaluated by the same run (check_specs), so the launch that materializes the
asset shows the check's verdict on the asset page and in the run.
"""

import dagster as dg

from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.defs.devstats.assets import dim_layout_group
from pin_pipelines.defs.metadata import id_list
from pin_pipelines.defs.pools import CLICKHOUSE_POOL
from pin_pipelines.defs.reconcile.metadata import counts_table, repair_metadata, worst_rows_table
from pin_pipelines.defs.resources import CHESSBOARD_AGGREGATES, PinSettings
from pin_pipelines.reconcile import Repair, repair_aggregates, repair_dim
from pin_pipelines.reconcile import aggregates_drift as find_aggregates_drift
from pin_pipelines.reconcile import dim_layout_group_drift as find_dim_drift

GROUP = "reconcile"


class ReconcileConfig(dg.Config):
    """Launchpad config. Repair only enqueues and re-publishes; it never writes derived values."""

    repair: bool = False


@dg.asset(
    deps=[CHESSBOARD_AGGREGATES],
    group_name=GROUP,
    kinds={"postgres"},
    check_specs=[
        dg.AssetCheckSpec(
            "aggregates_consistent",
            asset="aggregates_drift",
            description="Fails when a stored counter or bound differs from count(*)/min/max.",
        )
    ],
    description=(
        "Denormalized counters and price/area bounds of projects, buildings, layouts and layout "
        "groups of every non-archived project, compared with count(*)/min/max over "
        "property_objects/layouts (spec 000 runbook: расхождение денормализации). "
        "Config repair: true enqueues every drifted project due now."
    ),
)
def aggregates_drift(config: ReconcileConfig, pin: PinSettings) -> dg.MaterializeResult:
    settings = pin.get()
    drift = find_aggregates_drift(settings.pg_dsn)
    repair = Repair(repair_aggregates(settings.pg_dsn, drift), 0) if config.repair else None
    summary = drift.summary()
    unexplained = drift.unexplained
    metadata = {
        "projects_checked": summary["projects_checked"],
        "projects_drifted": summary["projects_drifted"],
        "projects_drifted_queued": summary["projects_drifted_queued"],
        "projects_drifted_poisoned": summary["projects_drifted_poisoned"],
        "counts": counts_table(drift.checked, drift.drifted),
        "columns_drifted": dg.MetadataValue.json(summary["columns_drifted"]),
        "worst_drifted_rows": worst_rows_table(drift.rows),
        "drifted_project_ids": id_list(drift.project_ids),
        **repair_metadata(repair),
    }
    if not drift.rows:
        verdict = "no drift"
    elif repair is not None:
        verdict = (
            f"{len(drift.project_ids)} drifted project(s) enqueued due now; the drain heals them — "
            "materialize again after it ran to confirm"
        )
    elif unexplained:
        verdict = (
            f"{len(unexplained)} drifted project(s) that nothing will recalc: launch again with "
            "repair: true, or force_recalc_job with drifted_project_ids"
        )
    else:
        verdict = "every drifted project is already queued (recent edits): the drain heals them"
    check = dg.AssetCheckResult(
        check_name="aggregates_consistent",
        passed=not drift.rows,
        # Drift the queue already covers is expected under live edits: a warning, not an alert.
        severity=(
            dg.AssetCheckSeverity.WARN
            if drift.rows and not unexplained
            else dg.AssetCheckSeverity.ERROR
        ),
        description=verdict,
        metadata={
            "projects_drifted": summary["projects_drifted"],
            "projects_unexplained": len(unexplained),
            "unexplained_project_ids": id_list(unexplained),
        },
    )
    return dg.MaterializeResult(metadata=metadata, check_results=[check])


@dg.asset(
    # Its pool: chdb admits one process per folder, so it never runs beside the loader.
    deps=[dim_layout_group, CHESSBOARD_AGGREGATES],
    group_name=GROUP,
    kinds={"clickhouse", "postgres"},
    pool=CLICKHOUSE_POOL,
    check_specs=[
        dg.AssetCheckSpec(
            "dim_layout_group_in_sync",
            asset="dim_layout_group_drift",
            description="Fails when dim_layout_group differs from chessboard.layout_groups.",
        )
    ],
    description=(
        "dim_layout_group (argMax reads) compared with chessboard.layout_groups: missing rows, "
        "stale or ahead versions, other name/sort order/archived flag/parents, rows without a "
        "source group. Config repair: true re-publishes drifted groups with a bumped Version, so "
        "the dimension heals through outbox → Kafka → loader."
    ),
)
def dim_layout_group_drift(config: ReconcileConfig, pin: PinSettings) -> dg.MaterializeResult:
    settings = pin.get()
    with open_clickhouse(
        settings.clickhouse_url, password_file=settings.clickhouse_password_file
    ) as ch:
        drift = find_dim_drift(settings.pg_dsn, ch)
    repair = Repair(0, repair_dim(settings.pg_dsn, drift)) if config.repair else None
    kinds = drift.by_kind
    unexpected = [gid for gid, kind in drift.kinds.items() if kind == "unexpected"]
    metadata = {
        "dim_rows_checked": drift.checked,
        "dim_rows_drifted": drift.drifted,
        **{f"dim_{kind}": n for kind, n in kinds.items()},
        "worst_drifted_rows": worst_rows_table(drift.rows),
        "drifted_layout_group_ids": id_list(sorted(drift.kinds, key=str)),
        **repair_metadata(repair),
    }
    if not drift.kinds:
        verdict = "dim_layout_group matches chessboard.layout_groups"
    elif repair is not None:
        verdict = (
            f"{repair.layout_groups_republished} group(s) re-published; they heal after "
            "outbox relay and devstats load — materialize again to confirm"
        )
    else:
        verdict = "launch again with repair: true to re-publish the drifted groups"
    if unexpected:
        verdict += (
            f"; {len(unexpected)} row(s) have no source group and are never deleted "
            "automatically (docs/runbook.md)"
        )
    check = dg.AssetCheckResult(
        check_name="dim_layout_group_in_sync",
        passed=not drift.kinds,
        severity=dg.AssetCheckSeverity.ERROR,
        description=verdict,
        metadata={"dim_rows_drifted": drift.drifted, **{f"dim_{k}": n for k, n in kinds.items()}},
    )
    return dg.MaterializeResult(metadata=metadata, check_results=[check])
