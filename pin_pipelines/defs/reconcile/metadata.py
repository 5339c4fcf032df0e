"""Drift findings as Dagster metadata: what on-call reads in the asset's and the check's panels."""

from typing import Any

import dagster as dg

from pin_pipelines.reconcile import DriftRow, Repair, worst

DRIFT_COLUMNS = ("entity", "id", "project_id", "column", "stored", "expected")


def worst_rows_table(rows: list[DriftRow]) -> dg.MetadataValue:
    """The worst drifted rows (largest difference first), one row per drifted column."""
    return dg.MetadataValue.table(
        [dg.TableRecord(row.as_dict()) for row in worst(rows)],
        schema=dg.TableSchema(columns=[dg.TableColumn(name, "string") for name in DRIFT_COLUMNS]),
    )


def counts_table(checked: dict[str, int], drifted: dict[str, int]) -> dg.MetadataValue:
    return dg.MetadataValue.table(
        [
            dg.TableRecord({"entity": entity, "checked": checked.get(entity, 0), "drifted": n})
            for entity, n in drifted.items()
        ],
        schema=dg.TableSchema(
            columns=[
                dg.TableColumn("entity", "string"),
                dg.TableColumn("checked", "int"),
                dg.TableColumn("drifted", "int"),
            ]
        ),
    )


def repair_metadata(repair: Repair | None) -> dict[str, Any]:
    if repair is None:
        return {"repair": "not requested (launch with config repair: true to repair)"}
    return {f"repaired_{name}": n for name, n in repair.as_dict().items()}
