"""The relay job: publishes the outbox for a while, so one launch serves many 5-second ticks."""

import time
from collections.abc import Iterator

import dagster as dg

from pin_pipelines.config import Settings
from pin_pipelines.defs.relay.assets import TOPIC_ASSETS
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.errors import PinError
from pin_pipelines.relay import OutboxRelay, RelaySummary, topic_end_offsets

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
    settings = pin.get()
    total = RelaySummary()
    deadline = time.monotonic() + config.budget_seconds
    idle_since = time.monotonic()
    try:
        # One relay (one transactional producer) for the whole run: a new one costs up to half
        # a second. It holds the relay lock meanwhile: a `pin outbox relay --once` started by
        # hand waits for the run (its lock_timeout, 60 s, is longer than the budget).
        with OutboxRelay(settings) as relay:
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
        yield from _report(context, settings, total)
        raise
    yield from _report(context, settings, total)


def _report(
    context: dg.OpExecutionContext, settings: Settings, total: RelaySummary
) -> Iterator[dg.AssetMaterialization]:
    topics = [t for t in TOPIC_ASSETS if total.published_by_topic.get(t)]
    try:
        # The topics' end offsets after the run: each partition's next offset, which is past
        # every event this run published (the relay learns of failures only, not of offsets).
        ends = topic_end_offsets(settings.kafka_bootstrap, topics) if topics else {}
    except PinError as exc:  # the broker went away: the counts are still worth recording
        context.log.warning(f"end offsets not recorded: {exc}")
        ends = {}
    for topic in topics:
        yield dg.AssetMaterialization(
            asset_key=TOPIC_ASSETS[topic].key,
            metadata={
                "published": total.published_by_topic[topic],
                "dead_lettered": total.dead_lettered_by_topic.get(topic, 0),
                "end_offsets": dg.MetadataValue.json(
                    {str(p): o for p, o in sorted(ends.get(topic, {}).items())}
                ),
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
