"""The relay job: one long-lived run publishes the outbox continuously, then hands over.

A run relays for `budget_seconds`, woken by the commit of every transaction that wrote the
outbox (and at its backstop, PIN_RELAY_BACKSTOP_SECONDS), so an event reaches Kafka within a
fraction of a second of its commit instead of a sensor tick and a run launch later. The sensor
launches the successor shortly before the run's budget ends; the successor waits for the relay
lock (one publisher at a time, PostgreSQL advisory lock) and takes over when the run lets go of
it: no gap beyond a producer's start, and no overlap that could reorder a key (the lock, and the
transactional.id that fences a predecessor). A stop (run cancel, `pin serve` stopping, a stop
signal to the run worker) lets the batch in hand commit.
"""

from collections.abc import Iterator

import dagster as dg

from pin_pipelines.config import DEFAULT_LONG_RUN_SECONDS, Settings
from pin_pipelines.defs.relay.assets import TOPIC_ASSETS
from pin_pipelines.defs.resources import PinSettings
from pin_pipelines.defs.stopping import stopped_by_signal
from pin_pipelines.errors import PinError
from pin_pipelines.relay import OutboxRelay, RelaySummary, topic_end_offsets
from pin_pipelines.worker import Budget

RELAY_JOB_TAGS = {"pin/job": "outbox_relay"}


class RelayConfig(dg.Config):
    #: How long one run relays before its successor takes over (a run's event log stays small:
    #: a summary and an asset event per topic per run).
    budget_seconds: float = float(DEFAULT_LONG_RUN_SECONDS)


@dg.op(tags={"kind": "kafka"}, out={})
def relay_outbox(
    context: dg.OpExecutionContext, config: RelayConfig, pin: PinSettings
) -> Iterator[dg.AssetMaterialization]:
    """A generator, so what was published before a failure (broker down after a while) is still
    recorded on its topics: events logged with `context.log_event` are dropped when the op raises,
    yielded ones are kept."""
    settings = pin.get()
    total = RelaySummary()
    try:
        # One relay (one transactional producer) for the whole run. It holds the relay lock
        # meanwhile: the successor, or a `pin outbox relay` started by hand, waits for it.
        with stopped_by_signal(context) as stop, OutboxRelay(settings) as relay:
            budget = Budget(config.budget_seconds, stop.requested)
            relay.run_until(budget.stopping, total=total)
    except Exception:
        yield from _report(context, settings, total)
        raise
    yield from _report(context, settings, total)
    stop.end()
    if total.last_error is not None:  # the run ended failing: red in the UI, with the reason
        raise dg.Failure(f"the relay was failing when its run ended: {total.last_error}")


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
