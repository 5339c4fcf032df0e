"""Spec 003's 5-minute freshness SLA as Dagster's own freshness for dim_layout_group: a
last-update freshness check (`build_last_update_freshness_checks`) that fails once the
dimension's last update is more than FRESHNESS_SLA_SECONDS old, shown on the asset's page with
Dagster's freshness wording, beside the topic- and version-based checks (checks.py).

Why an observation says when the dimension was last updated: the load runs are long-lived
(PIN_LONG_RUN_SECONDS, 600 s by default) and record their materialization when they end, so the
last materialization is up to a whole run old while the dimension is current, and a 5-minute
window on it would flap at every hand-over. What the SLA is about is the events: the dimension
is current up to the oldest event it has not loaded (now, when it has loaded everything). This
module's sensor records that moment every OBSERVE_SECONDS as an observation of the asset carrying
`dagster/last_updated_timestamp`, which the freshness check reads: a dimension whose oldest
unloaded event is more than 5 minutes old fails it (Dagster's `retrieve_last_update_record`
takes the newer of the last materialization and the last observation).
"""

import time
import warnings
from datetime import timedelta

import dagster as dg

from pin_pipelines.defs.devstats.assets import dim_layout_group
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.defs.stopping import STOPPING_REASON, instance_stopping
from pin_pipelines.devstats.loading import FRESHNESS_SLA_SECONDS, ConsumerLag, unloaded_events
from pin_pipelines.errors import PinError

#: The metadata key Dagster's last-update freshness checks read an observation's update time from.
LAST_UPDATED = "dagster/last_updated_timestamp"
#: How often the dimension's last update is observed: well within the SLA, so a current
#: dimension's last observation is never past it; each is an event row of the instance's storage.
OBSERVE_SECONDS = 120

# Evaluated every 5 minutes in the run of the project's own freshness check (checks.py), by a
# project schedule (it launches nothing while `pin serve` stops), not by Dagster's sensor for
# freshness checks, which would. Dagster 1.13 calls this superseded by FreshnessPolicy, which
# reads materializations only: the long-lived load runs' are no measure of the SLA (module
# docstring). Said once here, not as a warning at every load of the code location.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", dg.SupersessionWarning)
    [dim_layout_group_freshness_check] = dg.build_last_update_freshness_checks(
        assets=[dim_layout_group],
        lower_bound_delta=timedelta(seconds=FRESHNESS_SLA_SECONDS),
        severity=dg.AssetCheckSeverity.ERROR,
    )


def last_update(lag: ConsumerLag, now: float) -> dg.AssetObservation:
    """The dimension's observation for `lag`: current up to its oldest unloaded event, or `now`
    when it has loaded every event."""
    updated = now - (lag.oldest_age_seconds or 0.0)
    return dg.AssetObservation(
        asset_key=dim_layout_group.key,
        metadata={
            LAST_UPDATED: dg.MetadataValue.timestamp(updated),
            "unloaded_events": lag.events,
            "oldest_unloaded_age_seconds": lag.oldest_age_seconds or 0.0,
        },
    )


@dg.sensor(
    name="dim_layout_group_last_update_sensor",
    minimum_interval_seconds=OBSERVE_SECONDS,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description=(
        "Observes when dim_layout_group was last current (its oldest unloaded event, or now), "
        "for its freshness check: the 5-minute SLA of spec 003."
    ),
)
def dim_layout_group_last_update_sensor(
    context: dg.SensorEvaluationContext, pin: PinSettings
) -> dg.SensorResult | dg.SkipReason:
    if instance_stopping(context.instance):
        return dg.SkipReason(STOPPING_REASON)
    try:
        lag = unloaded_events(pin.get())
    except PinError as exc:  # nothing observed: the last update ages, as it should
        return dg.SkipReason(f"consumer lag unreadable: {exc}")
    return dg.SensorResult(asset_events=[last_update(lag, time.time())])
