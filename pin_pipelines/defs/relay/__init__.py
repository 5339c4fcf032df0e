"""The outbox relay in Dagster: the Kafka topics as assets downstream of the aggregates."""

import dagster as dg

from pin_pipelines.defs.relay.assets import TOPIC_ASSETS
from pin_pipelines.defs.relay.jobs import outbox_relay_job
from pin_pipelines.defs.relay.sensors import outbox_relay_sensor

defs = dg.Definitions(
    assets=list(TOPIC_ASSETS.values()),
    jobs=[outbox_relay_job],
    sensors=[outbox_relay_sensor],
)
