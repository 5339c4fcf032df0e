"""Spec 000 (project-aggregates-recalc): the debounce queue, its drain and the outbox writes.

The face other packages import (the Dagster wiring, `pin`, the reconciliation, the exporter):
the drain (`drain_tick`, `drain_until_idle`, `seconds_until_next_due`) and its summaries, the
enqueue side (`force_recalc`, `force_request` in the caller's transaction, `requeue_poisoned`),
the poisoned rows, the counters' label values and `pin sample load`. Behind it, the modules
import each other by module path; tests/unit/test_layering.py keeps the others out.
"""

from pin_pipelines.recalc.counters import ENTITIES, RESULT_LABELS
from pin_pipelines.recalc.drain import (
    DrainRunSummary,
    TickSummary,
    drain_tick,
    drain_until_idle,
    seconds_until_next_due,
)
from pin_pipelines.recalc.enqueue import RecalcReason, force_recalc, force_request, requeue_poisoned
from pin_pipelines.recalc.queue_status import PoisonedRequest, poisoned_requests
from pin_pipelines.recalc.sample import load_sample

__all__ = [
    "ENTITIES",
    "RESULT_LABELS",
    "DrainRunSummary",
    "PoisonedRequest",
    "RecalcReason",
    "TickSummary",
    "drain_tick",
    "drain_until_idle",
    "force_recalc",
    "force_request",
    "load_sample",
    "poisoned_requests",
    "requeue_poisoned",
    "seconds_until_next_due",
]
