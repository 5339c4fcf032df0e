"""The loader's process-level faults, each in a real subprocess as an operator meets them:

- killed with SIGKILL mid-cycle, after a batch was inserted and before its offsets were committed:
  the next run replays that batch and the dimension ends exactly as if nothing had happened;
- Kafka unreachable: `pin devstats load --once` exits non-zero with one line, no traceback.

The subprocesses never touch the session's in-process chdb folder: the embedded path gets a folder
of its own under tmp_path.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaException

from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.devstats.dim import groups
from pin_pipelines.devstats.loader import JOIN_TIMEOUT, LoadOptions
from pin_pipelines.devstats.offsets import CLOSE_TIMEOUT, DEFAULT_GROUP
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import wait_until
from tests.support.cli import PIN, assert_one_line_error, run_pin
from tests.support.devstats import Group, committed, open_transaction, produce_events
from tests.support.private_kafka import kill_broker, restart_broker

ROOT = Path(__file__).resolve().parents[2]

#: One load cycle in batches of 50 whose insert_events, on the N-th call, stops dead just before
#: sending its batch or just after the server confirmed storing it (a marker file tells the test
#: when it hangs there); either way the batch's offsets are not committed yet.
KILLED_LOAD = """
import sys, time
from pathlib import Path
from pin_pipelines.clickhouse import migrate_clickhouse, open_clickhouse
from pin_pipelines.config import Settings
from pin_pipelines.devstats import inserts, loader

topic, group, marker = sys.argv[1], sys.argv[2], Path(sys.argv[3])
stop_at, where = int(sys.argv[4]), sys.argv[5]
settings = Settings.from_env()
real_insert, calls = inserts.insert_events, []

def hang(stored):
    marker.write_text(str(stored))
    time.sleep(600)

def insert_with_a_stop(ch, events):
    events = list(events)
    calls.append(len(events))
    if len(calls) == stop_at and where == "before-insert":
        hang(0)
    stored = real_insert(ch, events)
    if len(calls) == stop_at:
        ch.confirm_insert()
        hang(stored)
    return stored

inserts.insert_events = insert_with_a_stop
with open_clickhouse(settings.clickhouse_url) as ch:
    migrate_clickhouse(ch)
    loader.load_once(settings, loader.LoadOptions(topic=topic, group=group, batch_size=50))
raise SystemExit("the load ended before it was killed")
"""

#: The next run (the replay), then the dimension as a reader and as the table see it.
REPLAY_AND_READ = """
import json, sys
from pin_pipelines.clickhouse import open_clickhouse
from pin_pipelines.config import Settings
from pin_pipelines.devstats.dim import groups
from pin_pipelines.devstats.loader import LoadOptions, load_once

topic, group, developer = sys.argv[1], sys.argv[2], sys.argv[3]
settings = Settings.from_env()
with open_clickhouse(settings.clickhouse_url) as ch:
    summary = load_once(settings, LoadOptions(topic=topic, group=group, batch_size=50))
    current = [
        [str(g.layout_group_id), str(g.project_id), g.name, g.sort_order, g.is_archived,
         g.source_version]
        for g in groups(ch, developer)
    ]
    stored = ch.rows(
        "SELECT LayoutGroupId, SourceVersion FROM pin_dev_stats.dim_layout_group "
        "WHERE DeveloperId = %(developer)s",
        {"developer": developer},
    )
print(json.dumps({
    "summary": summary.as_dict(),
    "groups": current,
    "stored": [[str(gid), int(version)] for gid, version in stored],
}))
"""


def python(script: str, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(params=["embedded", "server"])
def subprocess_clickhouse_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A ClickHouse the subprocesses may own: a fresh chdb folder, or the test server."""
    if request.param == "embedded":
        return f"chdb://{tmp_path / 'chdb'}"
    return str(request.getfixturevalue("clickhouse_server_url"))


@pytest.mark.parametrize("where", ["before-insert", "after-insert"])
def test_killed_mid_batch_replays_to_the_same_end_state(
    where: str,
    subprocess_clickhouse_url: str,
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    developer = uuid.uuid4()
    history = [Group(developer_id=developer) for _ in range(300)]
    rng = random.Random(5)
    events: list[dict[str, Any]] = []
    for group in history:  # each group's three versions out of order, groups interleaved
        events += [group.event(v, SortOrder=v, IsArchived=v == 3) for v in rng.sample([1, 2, 3], 3)]
    rng.shuffle(events)
    produce_events(kafka_bootstrap, loader_options.topic, events)
    env = {"PIN_CLICKHOUSE_URL": subprocess_clickhouse_url}
    topic, group_id = loader_options.topic, loader_options.group

    marker = tmp_path / "inserted-not-committed"
    killed = python(KILLED_LOAD, topic, group_id, str(marker), "4", where, env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert killed.poll() is None, killed.communicate()
            assert time.monotonic() < deadline, "the load never reached its fourth insert"
            time.sleep(0.05)
        time.sleep(0.1)  # the marker's text is written
        stored_before_kill = int(marker.read_text())
        assert (stored_before_kill > 0) == (where == "after-insert")
        killed.send_signal(signal.SIGKILL)
    finally:
        killed.kill()
        killed.communicate()
    assert killed.returncode == -signal.SIGKILL
    offsets = committed(kafka_bootstrap, topic, group_id)
    assert sum(max(0, o) for o in offsets.values()) < len(events)  # the killed batch is uncommitted

    replay = python(REPLAY_AND_READ, topic, group_id, str(developer), env=env)
    out, err = replay.communicate(timeout=120)
    assert replay.returncode == 0, err
    state = json.loads(out.strip().splitlines()[-1])

    summary = state["summary"]
    assert summary["complete"] and set(summary["lag"].values()) == {0}
    # A batch stored but not committed is read again and skipped by the guard, not re-applied.
    assert summary["skipped_stale"] >= stored_before_kill
    newest = {e["Id"]: e for e in events if e["Version"] == 3}
    assert sorted(state["groups"]) == sorted(  # one logical row per group: the newest version
        [e["Id"], e["ProjectId"], e["Name"], e["SortOrder"], e["IsArchived"], e["Version"]]
        for e in newest.values()
    )
    stored = [tuple(row) for row in state["stored"]]
    assert len(stored) == len(set(stored)), "an event was stored twice"
    assert {gid for gid, _ in stored} == set(newest)
    assert committed(kafka_bootstrap, topic, group_id) == _ends(kafka_bootstrap, topic)


def _ends(bootstrap: str, topic: str) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4()}"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return {
            p: int(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1])
            for p in partitions
        }
    finally:
        consumer.close()


def test_kafka_unreachable_is_one_line_error(tmp_path: Path) -> None:
    result = run_pin(
        "devstats",
        "load",
        "--once",
        env={
            "PIN_KAFKA_BOOTSTRAP": "127.0.0.1:1",
            "PIN_CLICKHOUSE_URL": f"chdb://{tmp_path / 'chdb'}",
        },
        timeout=60,
    )
    assert_one_line_error(result, "Kafka at 127.0.0.1:1")
    assert result.stdout.strip() == ""  # no summary: nothing was loaded


def test_broker_killed_after_the_first_commit_ends_the_load_in_one_line(
    kafka: LocalKafka,
    clickhouse_server_url: str,
    tmp_path: Path,
) -> None:
    """Tried: `pin devstats load --once` over 60,000 events on a private broker, the broker
    killed with SIGKILL as soon as the group's first offsets are committed, and kept down.
    librdkafka's close waited for the cycle's outstanding commits for as long as the coordinator
    was gone: the load hung (still there after 400 s). Now it ends non-zero within its
    join timeout and the bounded close, with one line naming Kafka; once the broker is back, the
    next load resumes from the committed offsets and ends exact.

    The load cannot end before the kill: a Kafka transaction left open after the 60,000 events
    holds one partition's readable end (read_committed) short of the watermark the load reads
    to, so the load waits there (up to its 300 s cycle) once the rest is loaded. Before, the
    load loaded and committed everything in ~2 s, sometimes before the test saw its first
    commit, and the test killed the broker after the load had ended. The transaction is aborted
    once the broker is back, and the next load reads past it."""
    bootstrap = kafka.settings.kafka_bootstrap
    developer = uuid.uuid4()
    history = [Group(developer_id=developer) for _ in range(6000)]
    produce_events(
        bootstrap, TOPIC_LAYOUT_GROUP, [g.event(v) for v in range(1, 11) for g in history]
    )
    holder = open_transaction(bootstrap, TOPIC_LAYOUT_GROUP, history[0].event(11))
    env = {
        "PIN_KAFKA_BOOTSTRAP": bootstrap,
        "PIN_CLICKHOUSE_URL": clickhouse_server_url,
        "PIN_STATE_DIR": str(tmp_path / "state"),
    }

    def first_commit() -> bool:
        assert load.poll() is None, f"the load ended before the kill: {load.communicate()}"
        try:
            offsets = committed(bootstrap, TOPIC_LAYOUT_GROUP, DEFAULT_GROUP)
        except KafkaException:
            return False
        return sum(max(0, o) for o in offsets.values()) > 0

    load = subprocess.Popen(
        [PIN, "devstats", "load", "--once"],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(first_commit, timeout=60, what="the load's first commit")
        kill_broker(kafka)
        killed_at = time.monotonic()
        _, err = load.communicate(timeout=JOIN_TIMEOUT + CLOSE_TIMEOUT + 60)
        ended_after = time.monotonic() - killed_at
    finally:
        if load.poll() is None:
            load.kill()
            load.communicate()
        restart_broker(kafka)
        holder.abort_transaction(30)
    assert_one_line_error(
        subprocess.CompletedProcess(load.args, load.returncode, "", err), f"Kafka at {bootstrap}"
    )
    assert ended_after < JOIN_TIMEOUT + CLOSE_TIMEOUT + 30

    result = run_pin("devstats", "load", "--once", env=env, timeout=180)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["complete"]
    with open_clickhouse(clickhouse_server_url) as ch:
        assert {(g.layout_group_id, g.source_version) for g in groups(ch, developer)} == {
            (g.id, 10) for g in history
        }
    assert committed(bootstrap, TOPIC_LAYOUT_GROUP, DEFAULT_GROUP) == _ends(
        bootstrap, TOPIC_LAYOUT_GROUP
    )
