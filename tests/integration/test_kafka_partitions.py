"""A minority partition of the 3-broker Kafka cluster: the leader of a layout-group
partition cut off from the other two brokers, not killed, while `pin outbox relay` publishes
from the outbox and two `pin devstats load` consume into the ClickHouse server's dimension; then
healed. A Jepsen-style checker (tests/support/history.py) reads the whole history, every outbox
event → Kafka read_committed → `dim_layout_group`, and finds nothing lost, duplicated, reordered,
stale or unexpected. The cluster is the session's private one (tests/support/kafka_cluster.py),
reset for this module.

How one broker is cut off on loopback (all three JVMs listen on 127.0.0.1, so a port rule cuts
the clients too). Evaluated:
(a) iptables `-m cgroup --path` in OUTPUT, chosen (`blackhole.isolate`): every loopback packet
    passes OUTPUT with the socket that sent it. Measured on this kernel (6.18, iptables-nft
    1.8.9, cgroup2 at /sys/fs/cgroup/unified): a socket keeps the cgroup of the process that
    created it (one opened before its process moved is not matched, a new one is), and a
    listener's accepted sockets carry the listener's cgroup. So the JVMs are moved into one
    cgroup per side and a side's packets to the other side's broker and controller ports are
    dropped (new connections hang in SYN-SENT), and the 22-34 connections already open between
    the sides (listed with `ss -p`) are each cut by their port pair, both directions.
(b) a loopback address per broker (127.0.0.2-4): rejected. The listeners are 127.0.0.1 in
    pin_pipelines/stack/kafka.py (a product change), and address pairs would not tell a broker's
    outgoing connections from a client's: the local route of 127/8 has `src 127.0.0.1`, so an
    unbound socket connecting to 127.0.0.3 gets source 127.0.0.1 (measured).
(c) a network namespace per broker: rejected. A running JVM cannot be moved into one (setns is
    for the caller only), so the cluster would need its own launcher, veths and routes for the
    clients: heavier than (a) for the same cut.

What is cut, asserted in every run while the cut is on: new connections from the victim's cgroup
to another node's broker and controller port, and from the other nodes' cgroup to the victim's,
hang; the victim still reaches its own controller; a client (this test) gets a Kafka answer
(ApiVersions) from a majority broker, and from the victim only in
`clients-reach-the-isolated-leader` (in `clients-cut-too` its broker port is also blackholed for
everyone, INPUT rules of `blackhole`); the rules dropped packets both ways (145-247 per run); the
majority's metadata fenced the victim and moved partition 0 within 5.2-8.4 s. With clients
reaching it the victim answers with its stale view: a client that asked it (exploration, not
asserted: librdkafka picks which broker answers) was told the victim led partition 0 with the
full ISR while the majority named another leader.

Measured (2-core machine, load average 4-13 from other work; 6 runs of each case with 40 s
cuts, in one of them the victim chosen as the loader group's coordinator, and in clients-cut-too
the relay's transaction coordinator too; 3 runs with 25 s cuts; times from the cut, or from the
heal = every rule deleted):
- The relay publishes nothing for its first ~30 s in both cases: a transaction spans every
  partition, and nothing refuses the cut-off leader's share (blackholed it is silent; reachable
  it waits for acks=all from followers that cannot fetch), so the batch waits out the 30 s
  message timeout (the relay's failure at 29.7-36.5 s after the cut); it aborts, and its
  next producer publishes through the new leaders 1.5-3.4 s later (31.9-38.4 s after the cut).
  Once (clients-cut-too) the next commit waited its own 35 s bound instead and nothing was
  published before the heal (4.3 s after it). With 25 s cuts nothing was published before the
  heal (first delivery 26.3, 28.0 and 32.2 s after the cut): hence ISOLATED_SECONDS 40.
- A read_committed consumer with librdkafka's defaults (the live reader) got the victim's
  partitions back only after the heal, though the new leaders had their events from ~32 s: it
  had every event written before the heal 0.6-5.2 s after it while it could reach the victim
  (presumably fetching from the stale leader, which had nothing new), 13.1-14.8 s after it when the
  victim was blackholed (its silent connection waits out TCP's retransmission backoff). The
  loaders (Kafka requests fail over after 15 s) had every event written before the heal in the
  dimension 0.3-5.0 s after it; their freshness max over a run 10.8-40.5 s.
- Catch-up after the heal: every event written before it published 0.0-4.3 s, in the dimension
  0.3-5.0 s after it; everything, with writes going on 5 s after the heal (3 s, as now, in the
  last two runs), in the dimension and the loader group at the end 3.6-6.3 s after it.
- Checker: 10,300-11,550 events per run (8,000-9,400 with 25 s), lost, duplicated, reordered,
  stale and unexpected 0 in every run, for the live read and for the read after the heal.
- The module: 141-178 s, of which the cluster's start 16-55 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from functools import partial

import psycopg
import pytest

from pin_pipelines.config import Settings
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP, admin
from pin_pipelines.relay import topic_end_offsets as end_offsets
from pin_pipelines.relay.outbox import DELIVERY_TIMEOUT
from pin_pipelines.stack.kafka_cluster import LocalKafkaCluster
from pin_pipelines.stack.process import read_pid, wait_until
from tests.support.blackhole import Isolation, Peer, blackhole, isolate
from tests.support.cli import PIN, finish, load_summary, stop_all
from tests.support.devstats import Group, coordinator, group_at_end, group_offsets, shares
from tests.support.history import (
    LiveReader,
    Read,
    Written,
    check,
    dimension_versions,
    live_reader,
    read_committed,
    write_outbox,
)
from tests.support.kafka_cluster import (
    CLICKHOUSE_URL,
    cluster_settings,
    continuous_load,
    env_of,
    leader,
    restore,
)
from tests.support.outbox import outbox_count

#: Beside the other workers, after test_kafka_cluster.py on the same worker (one start of the
#: session's private cluster for both): every rule is of this worker's cluster, its JVMs' cgroups
#: and ports, which no other worker uses; the bounds below were measured under a load average of
#: 4-13 from other work.
pytestmark = pytest.mark.xdist_group("kafka-cluster")

#: How long the leader stays cut off: past its fencing (broker.session.timeout.ms 6 s), and past
#: the relay's own bound, its 30 s delivery timeout (DELIVERY_TIMEOUT): a silent leader answers
#: nothing, so before that the relay has nothing to act on (with 25 s it published nothing until
#: the heal, measured), and the partition would never reach its abort and new producer.
ISOLATED_SECONDS = 40.0
#: Events written to the outbox per second, over KEYS layout groups (each gets Version 1, 2, …).
RATE = 200.0
KEYS = 300
#: Writes go on this long after the heal, then stop; everything must then arrive within SETTLE.
AFTER_HEAL_SECONDS = 3.0
SETTLE_SECONDS = 120.0


@pytest.fixture
def settings(cluster: LocalKafkaCluster, pg_dsn: str, tmp_path: os.PathLike[str]) -> Settings:
    return cluster_settings(cluster, pg_dsn, tmp_path)


class OutboxWriter:
    """Writes the next Version of the next CHUNK groups into the outbox, one transaction each,
    at `rate` events/s, in a thread; `written` is the history as PostgreSQL committed it."""

    CHUNK = 50

    def __init__(self, dsn: str, groups: list[Group], rate: float) -> None:
        self.dsn, self.groups, self.rate = dsn, groups, rate
        self.written: list[Written] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outbox-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            begin, sent, version = time.monotonic(), 0, 0
            while not self._stop.is_set():
                version += 1
                for at in range(0, len(self.groups), self.CHUNK):
                    if self._stop.is_set():
                        return
                    events = [g.event(version) for g in self.groups[at : at + self.CHUNK]]
                    try:
                        self.written += write_outbox(conn, TOPIC_LAYOUT_GROUP, events)
                    except Exception as exc:  # not committed: not part of the history
                        self.errors.append(repr(exc))
                    sent += len(events)
                    self._stop.wait(max(0.0, begin + sent / self.rate - time.monotonic()))

    def stop(self) -> list[Written]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        return self.written


def peers(nodes: LocalKafkaCluster) -> dict[int, Peer]:
    """Each node's JVM and the ports it listens on (broker, controller), by node id."""
    found = {}
    for node in nodes.nodes:
        pid = read_pid(node.pidfile)
        assert pid is not None, f"Kafka node {node.node_id} is not running"
        found[node.node_id] = Peer(f"node-{node.node_id}", pid, (node.port, node.controller_port))
    return found


def view(bootstrap: str) -> tuple[dict[int, int], set[int]]:
    """The layout-group topic's leaders and the registered (unfenced) brokers, as the brokers
    of `bootstrap` answer."""
    metadata = admin(bootstrap).list_topics(TOPIC_LAYOUT_GROUP, timeout=5)
    partitions = metadata.topics[TOPIC_LAYOUT_GROUP].partitions
    return {p: int(m.leader) for p, m in partitions.items()}, set(metadata.brokers)


class Milestones:
    """The first time each condition held, in seconds from `since`, sampled every 0.25 s; an
    exception counts as not yet (a broker or the dimension settling)."""

    def __init__(self, since: float) -> None:
        self.since = since
        self.reached: dict[str, float | None] = {}

    def poll(self, conditions: dict[str, Callable[[], bool]]) -> bool:
        """Sample the conditions not reached yet; whether all of them have been."""
        for name, condition in conditions.items():
            if self.reached.get(name) is None:
                self.reached[name] = None
                with contextlib.suppress(Exception):
                    if condition():
                        self.reached[name] = time.monotonic() - self.since
        return all(self.reached[name] is not None for name in conditions)

    def poll_until(
        self, until: float, conditions: dict[str, Callable[[], bool]], early: bool = False
    ) -> None:
        """Sample until `until` (monotonic), or, `early`, until every condition was reached."""
        while not (self.poll(conditions) and early) and time.monotonic() < until:
            time.sleep(0.25)


def first_read_after(
    written: list[Written], reads: list[Read], after: float, partitions: set[int] | None = None
) -> float | None:
    """Seconds from `after` until the live read_committed consumer was first handed an event
    written after it (on `partitions` when given)."""
    when = {(w.key, w.version): w.at for w in written}
    delivered = [
        r.at
        for r in reads
        if r.at is not None
        and (when.get((r.key, r.version)) or 0.0) > after
        and (partitions is None or r.partition in partitions)
    ]
    return min(delivered) - after if delivered else None


def published_up_to(conn: psycopg.Connection, event: Written | None) -> bool:
    """Whether the relay has published `event` and all before it: it publishes the outbox in id
    order and deletes what it published."""
    if event is None:
        return False
    row = conn.execute(
        "SELECT count(*) FROM chessboard.outbox_events WHERE id <= %s", (event.outbox_id,)
    ).fetchone()
    return row is not None and row[0] == 0


def stored_at_least(keys: set[str], versions: dict[str, int]) -> bool:
    """Whether the dimension holds each key at `versions` or newer."""
    stored = dimension_versions(CLICKHOUSE_URL, keys)
    return all(stored.get(key, 0) >= version for key, version in versions.items())


def caught_up(
    conn: psycopg.Connection, reader: LiveReader, keys: set[str], events: list[Written], which: str
) -> dict[str, Callable[[], bool]]:
    """The three legs having delivered every one of `events`: the relay (out of the outbox),
    Kafka (the live read_committed consumer handed them) and the loaders (in the dimension)."""
    last = {w.key: w.version for w in events}
    newest = max(events, key=lambda w: w.outbox_id or 0, default=None)
    return {
        f"relay published every event {which}": partial(published_up_to, conn, newest),
        f"live consumer handed every event {which}": partial(reader.has_read, events),
        f"dimension holds every event {which}": partial(stored_at_least, keys, last),
    }


def group_at_topic_end(bootstrap: str) -> bool:
    ends = end_offsets(bootstrap, [TOPIC_LAYOUT_GROUP])[TOPIC_LAYOUT_GROUP]
    return group_offsets(bootstrap) == ends


def transaction_coordinator(bootstrap: str, transactional_id: str) -> int:
    """The node coordinating the relay's transactions: the leader of its `__transaction_state`
    partition, Utils.abs(String.hashCode) of the id modulo the partitions, as Kafka places it."""
    code = 0
    units = transactional_id.encode("utf-16-be")
    for i in range(0, len(units), 2):
        code = (31 * code + int.from_bytes(units[i : i + 2], "big")) & 0xFFFFFFFF
    topic = "__transaction_state"
    partitions = admin(bootstrap).list_topics(topic, timeout=10).topics[topic].partitions
    return int(partitions[(code & 0x7FFFFFFF) % len(partitions)].leader)


def kafka_answers(port: int, timeout: float = 5.0) -> bool:
    """Whether a Kafka broker on 127.0.0.1:`port` answers a request (ApiVersions v0, which every
    broker answers) on a new connection of this process, a client of the cluster."""
    request = struct.pack(">hhih", 18, 0, 7, len(b"pin-test")) + b"pin-test"
    answer = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(struct.pack(">i", len(request)) + request)
            while len(answer) < 10 and (chunk := sock.recv(10 - len(answer))):
                answer += chunk
    except OSError:
        return False
    return len(answer) == 10 and struct.unpack(">iih", answer)[1:] == (7, 0)


def probe_the_cut(cut: Isolation, victim: Peer, other: Peer) -> dict[str, bool]:
    """Which new connections go through while the cut is on: from the two sides' cgroups (as
    a broker's own reconnects) and from this test (a client)."""
    return {
        "victim → another broker": cut.reaches("inside", other.ports[0]),
        "victim → another controller": cut.reaches("inside", other.ports[1]),
        "another node → the victim's broker": cut.reaches("outside", victim.ports[0]),
        "another node → the victim's controller": cut.reaches("outside", victim.ports[1]),
        "victim → its own controller": cut.reaches("inside", victim.ports[1]),
        "a client → the victim's broker (Kafka answers)": kafka_answers(victim.ports[0]),
        "a client → another broker (Kafka answers)": kafka_answers(other.ports[0]),
    }


def relay_failures(stderr: str, since: datetime) -> list[str]:
    """The relay's failed runs (its `relay_failed` log lines), as seconds after `since`: the
    error's first words."""
    failures = []
    for line in stderr.splitlines():
        if '"relay_failed"' in line:
            record = json.loads(line[line.index("{") :])
            after = (datetime.fromisoformat(record["ts"]) - since).total_seconds()
            failures.append(f"{after:.1f}: {record.get('error', '')[:150]}")
    return failures


@contextlib.contextmanager
def pipeline(config: Settings) -> Iterator[list[subprocess.Popen[str]]]:
    """`pin outbox relay` and two `pin devstats load`, continuous, on this module's cluster:
    killed and reaped at the end unless they stopped before."""
    started: list[subprocess.Popen[str]] = []
    try:
        started.append(
            subprocess.Popen(
                [PIN, "outbox", "relay"],
                env=env_of(config),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        started += [continuous_load(config), continuous_load(config)]
        yield started
    finally:
        stop_all(*started)


@pytest.mark.parametrize(
    "clients_reach_it", [True, False], ids=["clients-reach-the-isolated-leader", "clients-cut-too"]
)
def test_a_leader_cut_off_from_the_other_brokers_loses_duplicates_reorders_nothing(
    clients_reach_it: bool,
    cluster: LocalKafkaCluster,
    settings: Settings,
    outbox: psycopg.Connection,
) -> None:
    """Tried: layout-group events of 300 groups written to the outbox at 200 events/s (each
    group's Versions 1, 2, … in turn) while a continuous relay publishes them and two continuous
    loaders of one group load them; once both loaders hold partitions and events arrive, the
    leader of layout-group partition 0 is cut off from the other two brokers for 40 s (every
    packet between its JVM and theirs dropped, `blackhole.isolate`), writes going on. With
    `clients-reach-the-isolated-leader` every client still reaches it (and it answers with its
    stale view); with `clients-cut-too` its broker port is blackholed for everyone as well.
    Healed, writes go on 3 s, then stop. Then: the outbox is empty, the loader group at the
    topic's end, both loaders stop complete on SIGTERM, and the checker, over every written
    event, what a read_committed consumer was handed live through the fault and what one reads
    afterwards, and the dimension's argMax rows, finds nothing lost, duplicated, reordered,
    stale or unexpected."""
    bootstrap = cluster.bootstrap
    group_at_end(bootstrap)
    start = {TOPIC_LAYOUT_GROUP: end_offsets(bootstrap, [TOPIC_LAYOUT_GROUP])[TOPIC_LAYOUT_GROUP]}
    developer = uuid.uuid4()
    groups = [Group(developer_id=developer) for _ in range(KEYS)]
    keys = {str(g.id) for g in groups}
    writer = OutboxWriter(settings.pg_dsn, groups, RATE)
    try:
        with live_reader(bootstrap, start, keys) as reader, pipeline(settings) as processes:
            relay, *loaders = processes
            writer.start()
            wait_until(
                lambda: len(split := shares(bootstrap)) == 2 and all(split),
                timeout=90,
                what="both loaders holding partitions",
            )
            warm = time.monotonic()
            wait_until(
                lambda: first_read_after(writer.written, reader.snapshot(), warm) is not None,
                timeout=60,
                what="events flowing outbox → Kafka",
            )
            nodes = peers(cluster)
            victim = leader(bootstrap, TOPIC_LAYOUT_GROUP, 0)
            victim_led = {p for p, node in view(bootstrap)[0].items() if node == victim}
            victim_coordinates = {
                "the loader group": coordinator(bootstrap) == victim,
                "the relay's transactions": (
                    transaction_coordinator(bootstrap, settings.relay_transactional_id) == victim
                ),
            }
            others = [peer for node, peer in nodes.items() if node != victim]
            majority = ",".join(f"127.0.0.1:{peer.ports[0]}" for peer in others)

            def failed_over() -> bool:
                leaders, registered = view(majority)
                return leaders[0] not in (victim, -1) and victim not in registered

            def published_after_the_cut() -> bool:
                written_after = (w for w in list(writer.written) if (w.at or 0.0) > isolated)
                return published_up_to(outbox, next(written_after, None))

            clients_cut = (
                contextlib.nullcontext() if clients_reach_it else blackhole(nodes[victim].ports[0])
            )
            with isolate([nodes[victim]], others) as cut, clients_cut:
                isolated, cut_at = time.monotonic(), datetime.now(UTC)
                during = Milestones(isolated)
                with ThreadPoolExecutor(1) as pool:
                    probing = pool.submit(probe_the_cut, cut, nodes[victim], others[0])
                    during.poll_until(
                        isolated + ISOLATED_SECONDS,
                        {
                            "leader moved, victim fenced (majority's metadata)": failed_over,
                            "relay published an event written after the cut": (
                                published_after_the_cut
                            ),
                        },
                    )
                    probed = probing.result()
                dropped = cut.dropped()
            healed = time.monotonic()
            after = Milestones(healed)
            before_heal = caught_up(outbox, reader, keys, list(writer.written), "before the heal")
            after.poll_until(healed + AFTER_HEAL_SECONDS, before_heal)
            written = writer.stop()
            after.poll_until(
                healed + AFTER_HEAL_SECONDS + SETTLE_SECONDS,
                {
                    **before_heal,
                    **caught_up(outbox, reader, keys, written, "(writes stopped at +3 s)"),
                    "loader group at the topic's end": partial(group_at_topic_end, bootstrap),
                },
                early=True,
            )
            for process in processes:
                process.send_signal(signal.SIGTERM)
            relay_run = finish(relay, timeout=60)
            relayed = load_summary(relay_run)
            loaded = [load_summary(finish(loader, timeout=60)) for loader in loaders]
            live = reader.stop()
        final = read_committed(bootstrap, start, keys)
        dimension = dimension_versions(CLICKHOUSE_URL, keys)
    finally:
        writer.stop()
        restore(cluster)

    figures: dict[str, object] = {
        "connections open between the sides, cut": len(cut.cut),
        "new connections during the cut (True: through)": probed,
        "packets dropped": sum(dropped.values()),
        **{f"{name} after the cut": s for name, s in during.reached.items()},
        "live consumer first handed an event written after the cut, after": (
            first_read_after(written, live, isolated)
        ),
        f"the same on the victim's partitions {sorted(victim_led)}": (
            first_read_after(written, live, isolated, victim_led)
        ),
        **{f"{name} after the heal": s for name, s in after.reached.items()},
        "written": len(written),
        "relay": {k: relayed.get(k) for k in ("published", "failed_runs", "last_error")},
        "relay failures (s after the cut: error)": relay_failures(relay_run.stderr, cut_at),
        "loaders consumed": [summary["consumed"] for summary in loaded],
        "loaders freshness max": [summary["freshness_max_seconds"] for summary in loaded],
        "the victim coordinated": victim_coordinates,
    }
    print(f"node {victim} isolated ({'clients reach it' if clients_reach_it else 'cut too'}):")
    for name, value in figures.items():
        print(f"  {name}: {f'{value:.1f}s' if isinstance(value, float) else value}")
    final_report = check(written, final, dimension)
    live_report = check(written, live, dimension)
    print(f"final read: {final_report.summary()}\nlive read: {live_report.summary()}")

    final_report.assert_clean()
    live_report.assert_clean()
    assert not writer.errors, writer.errors[:3]
    assert len(written) > RATE * ISOLATED_SECONDS  # writes went on through the partition
    assert during.reached["leader moved, victim fenced (majority's metadata)"] is not None
    # The cut was real, and only between the brokers (and, clients-cut-too, the clients): new
    # connections across it hang, the victim still reaches itself, clients the majority; and
    # packets the two sides sent each other were dropped, both ways.
    assert probed == {
        "victim → another broker": False,
        "victim → another controller": False,
        "another node → the victim's broker": False,
        "another node → the victim's controller": False,
        "victim → its own controller": True,
        "a client → the victim's broker (Kafka answers)": clients_reach_it,
        "a client → another broker (Kafka answers)": True,
    }
    assert any(tag.startswith("inside_to_") and n for tag, n in dropped.items()), dropped
    assert any(tag.startswith("outside_to_") and n for tag, n in dropped.items()), dropped
    assert outbox_count(outbox) == 0
    assert group_at_topic_end(bootstrap)
    assert all(summary["complete"] for summary in loaded), loaded
    assert ISOLATED_SECONDS > DELIVERY_TIMEOUT
