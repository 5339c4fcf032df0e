"""CHESSBOARD_RECALC_POISON in the UI: a failing check that names each parked project."""

import dagster as dg

from pin_pipelines.defs.resources import CHESSBOARD_AGGREGATES, PinSettings
from pin_pipelines.defs.schedules import check_schedule
from pin_pipelines.recalc import poisoned_requests


@dg.asset_check(
    asset=CHESSBOARD_AGGREGATES,
    description="Fails while any recalc queue row is parked as poison (attempt_count ≥ 5).",
)
def no_poisoned_recalc_requests(pin: PinSettings) -> dg.AssetCheckResult:
    rows = poisoned_requests(pin.get().pg_dsn)
    table = [
        dg.TableRecord(
            {
                "project_id": str(r.project_id),
                "tenant_id": str(r.tenant_id),
                "attempt_count": r.attempt_count,
                "last_error": (r.last_error or "")[:300],
                "last_reason": r.last_reason,
            }
        )
        for r in rows[:50]
    ]
    return dg.AssetCheckResult(
        passed=not rows,
        severity=dg.AssetCheckSeverity.ERROR,
        description=(
            "CHESSBOARD_RECALC_POISON: fix the cause in last_error, then launch "
            "requeue_poisoned_job with these project_ids"
            if rows
            else "no poisoned rows"
        ),
        metadata={
            "poisoned": len(rows),
            "project_ids": dg.MetadataValue.json([str(r.project_id) for r in rows]),
            "rows": dg.MetadataValue.table(
                table,
                schema=dg.TableSchema(
                    columns=[
                        dg.TableColumn("project_id", "string"),
                        dg.TableColumn("tenant_id", "string"),
                        dg.TableColumn("attempt_count", "int"),
                        dg.TableColumn("last_error", "string"),
                        dg.TableColumn("last_reason", "string"),
                    ]
                ),
            ),
        },
    )


poison_check_schedule = check_schedule(
    no_poisoned_recalc_requests,
    job_name="recalc_poison_check_job",
    # Every 5 minutes, not every minute: the alert itself comes from the metrics exporter, and a
    # run per minute was a sixth of the instance's storage (bench/bench_dagster_storage.py).
    cron="*/5 * * * *",
    description="Evaluates no_poisoned_recalc_requests every 5 minutes: the UI's parked rows.",
)
