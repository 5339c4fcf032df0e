"""A Kafka broker of the test session's own, for the modules that kill it, or that need a consumer
group or topic configuration no other session shares (never the shared broker on 9092).

It starts once per session (per xdist worker) with the jars `pin stack up` already fetched, and
each module that takes `kafka` gets it reset to the state of a new broker: running (a test may
have killed it), no topic but the project's, empty, and no consumer group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from pin_pipelines.config import Settings
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import ALL_TOPICS, TopicPolicy, admin, delete_topics, ensure_topics
from pin_pipelines.relay import topic_end_offsets as end_offsets
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import free_port, read_pid, wait_until


def _ports_pair() -> int:
    """A free port whose successor is free too (the broker's controller listens there)."""
    while True:
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@pytest.fixture(scope="session")
def private_kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """The session's private broker, started on first use and stopped at the session's end."""
    root = tmp_path_factory.mktemp("private-kafka")
    broker = LocalKafka(
        Settings.from_env(
            {"PIN_STATE_DIR": str(root), "PIN_KAFKA_BOOTSTRAP": f"127.0.0.1:{_ports_pair()}"}
        )
    )
    link_shared_jars(broker.libs)
    try:
        broker.up()
        yield broker
    finally:
        stop_broker(broker)


def link_shared_jars(libs: Path) -> None:
    """Link the Kafka jars `pin stack up` fetched at `libs` (its folder made), so that a private
    broker, cluster or estate starts without fetching them again."""
    shared = LocalKafka(Settings.from_env()).libs
    libs.parent.mkdir(parents=True, exist_ok=True)
    if shared.exists():
        libs.symlink_to(shared)


@pytest.fixture(scope="module")
def kafka(private_kafka_broker: LocalKafka) -> LocalKafka:
    """The private broker as a new one: running, the project's topics empty, no group."""
    reset_broker(private_kafka_broker)
    return private_kafka_broker


def reset_broker(broker: LocalKafka) -> None:
    """Up (a no-op when it runs), every topic but Kafka's own deleted and every consumer group
    with it, then the project's topics created again, each partition with its leader."""
    broker.up()
    bootstrap = broker.settings.kafka_bootstrap
    wait_until(lambda: _listed(bootstrap) is not None, timeout=60, what="the private broker")
    empty_kafka(bootstrap)
    wait_for_leaders(broker)


def empty_kafka(bootstrap: str, policy: TopicPolicy | None = None) -> None:
    """A private broker's or cluster's state as a new one's: `clear_broker`, then the project's
    topics created again (after `policy`, or the environment's settings)."""
    clear_broker(bootstrap)
    ensure_topics(bootstrap, ALL_TOPICS, policy)


def clear_broker(bootstrap: str, own: Mapping[str, Any] | None = None) -> None:
    """Every consumer group deleted, then every topic but Kafka's own (`__…`), until the broker
    no longer lists them. `own`: the admin client's settings (a listener of its own)."""
    client = admin(bootstrap, own)
    groups = [g.group_id for g in client.list_consumer_groups().result(timeout=15).valid]
    if groups:
        # A consumer the last module killed stays a member until its session times out: the
        # broker refuses to delete its group (NON_EMPTY_GROUP) until then.
        wait_until(
            lambda: _groups_deleted(client, groups),
            timeout=GROUP_SESSION_SECONDS,
            what="the consumer groups deleted (killed consumers' sessions expired)",
        )
    topics = tuple(t for t in _listed(bootstrap, own) or () if not t.startswith("__"))
    without_topics(bootstrap, topics, own)


#: Longer than any consumer's session timeout (librdkafka's default 45 s) that a test may kill.
GROUP_SESSION_SECONDS = 60.0


def _groups_deleted(client: AdminClient, groups: list[str]) -> bool:
    """Delete `groups`; whether every one is gone (False while one still has a member)."""
    gone = True
    for future in client.delete_consumer_groups(groups, request_timeout=15).values():
        try:
            future.result(timeout=15)
        except KafkaException as exc:
            if exc.args[0].code() == KafkaError.GROUP_ID_NOT_FOUND:
                continue
            if exc.args[0].code() != KafkaError.NON_EMPTY_GROUP:
                raise
            gone = False
    return gone


def without_topics(
    bootstrap: str, topics: tuple[str, ...], own: Mapping[str, Any] | None = None
) -> None:
    """Delete `topics` and wait until the broker no longer lists them."""
    delete_topics(bootstrap, topics, own)

    def deleted() -> bool:
        listed = _listed(bootstrap, own)
        return listed is not None and not set(topics) & set(listed)

    wait_until(deleted, timeout=30, what="the topics deleted")


def _listed(bootstrap: str, own: Mapping[str, Any] | None = None) -> list[str] | None:
    """The broker's topics, or None while it does not answer."""
    try:
        return list(admin(bootstrap, own).list_topics(timeout=10).topics)
    except KafkaException:
        return None


def restart_broker(broker: LocalKafka) -> None:
    """Start it again (a no-op when it runs) and wait until every partition has its leader."""
    broker.up()
    wait_for_leaders(broker)


def wait_for_leaders(broker: LocalKafka) -> None:
    """A broker that just started (or created topics) answers before it leads the partitions."""

    def offsets_answered() -> bool:
        try:
            end_offsets(broker.settings.kafka_bootstrap, list(ALL_TOPICS))
        except PinError:
            return False
        return True

    wait_until(offsets_answered, timeout=60, what="the private broker's partition leaders")


def stop_broker(broker: LocalKafka) -> None:
    """SIGTERM, SIGKILL after 30 s; returns once the JVM is gone and reaped."""
    pid = read_pid(broker.pidfile)
    broker.down()
    _reap(pid)


def kill_broker(broker: LocalKafka) -> None:
    """SIGKILL: no shutdown at all."""
    pid = read_pid(broker.pidfile)
    assert pid is not None, "the private broker is not running"
    os.kill(pid, signal.SIGKILL)
    _reap(pid)


def _reap(pid: int | None) -> None:
    """The broker is a child of this process (started detached, in its own session): collect
    its exit status, so no zombie is left."""
    if pid is not None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
