"""The relay job: publishes the outbox for a while, so one launch serves many 5-second ticks."""

import time
from collections.abc import Iterator

import dagster as dg

from pin_pipelines.defs.relay.assets import TOPIC_ASSETS
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.relay.outbox import OutboxRelay
from pin_pipelines.relay.summary import RelaySummary

RELAY_JOB_TAGS = {"pin/job": "outbox_relay"}


class RelayConfig(dg.Config):
    budget_seconds: float = 25.0
    #: Stop early once the outbox stayed empty this long.
    idle_seconds: float = 5.0


@dg.op(tags={"kind": "kafka"}, out={})
def relay_outbox(
    context: dg.OpExecutionContext, config: RelayConfig, pin: PinSettings
) -> Iterator[dg.AssetMaterialization]:
    """A generator, so what was published before a failure (broker down after a while) is still
    recorded on its topics: events logged with `context.log_event` are dropped when the op raises,
    yielded ones are kept."""
    total = RelaySummary()
    deadline = time.monotonic() + config.budget_seconds
    idle_since = time.monotonic()
    try:
        # One relay (one producer) for the whole run: a new producer costs about half a second.
        with OutboxRelay(pin.get()) as relay:
            while (
                time.monotonic() < deadline and time.monotonic() - idle_since < config.idle_seconds
            ):
                summary = relay.run_once()
                total.merge(summary)
                if summary.published or summary.dead_lettered:
                    idle_since = time.monotonic()
                else:
                    time.sleep(0.2)
    except Exception:
        yield from _report(context, total)
        raise
    yield from _report(context, total)


def _report(
    context: dg.OpExecutionContext, total: RelaySummary
) -> Iterator[dg.AssetMaterialization]:
    for topic, spec in TOPIC_ASSETS.items():
        published = total.published_by_topic.get(topic, 0)
        if not published:
            continue
        offsets = {str(p): o for p, o in sorted(total.offsets.get(topic, {}).items())}
        yield dg.AssetMaterialization(
            asset_key=spec.key,
            metadata={
                "published": published,
                "dead_lettered": total.dead_lettered_by_topic.get(topic, 0),
                "latest_offsets": dg.MetadataValue.json(offsets),
            },
        )
    context.log.info(f"relay summary: {total.as_dict()}")
    if total.dead_lettered:
        context.log.warning(
            f"{total.dead_lettered} outbox event(s) moved to chessboard.outbox_dead_letters"
        )


@dg.job(tags=RELAY_JOB_TAGS, description="Publish committed outbox events to Kafka.")
def outbox_relay_job() -> None:
    relay_outbox()
