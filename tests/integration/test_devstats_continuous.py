"""The continuous loader as real processes (`pin devstats load` without --once, each aimed at a
topic and group of its test): the readers answered while it runs on the embedded engine, a clean
stop on SIGTERM, and two loaders handing over while events flow on every ClickHouse path (the
embedded engine, a server, and the local cluster with PIN_CLICKHOUSE_CLUSTER).

A loader process is the `pin` command's own `main`, with `load_continuously` aimed at the test's
topic (the contract topic and the loader's group are shared by every test session on the
broker). The embedded folder is migrated by `pin db migrate` and read by this process through
the loader that owns it, with a `with open_clickhouse(…)` per read, closed at once: this process
never keeps the folder, so the loaders can always take it.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import uuid
from pathlib import Path

import dagster as dg
import pytest
from confluent_kafka import Producer

from pin_pipelines.config import Settings
from pin_pipelines.definitions import defs
from pin_pipelines.defs.reconcile.assets import dim_layout_group_drift
from pin_pipelines.defs.resources import RESOURCES
from pin_pipelines.devstats.freshness import unloaded_events
from pin_pipelines.devstats.loader import LoadOptions
from pin_pipelines.metrics import devstats as devstats_metrics
from pin_pipelines.stack.clickhouse_cluster import DEFAULT_CLUSTER
from tests.support.cli import run_pin, summary
from tests.support.clickhouse import engine_url
from tests.support.devstats import Group, committed, end_offsets, produce_events
from tests.support.loaders import loader_env, loaders, versions, wait_for

#: Some tests run on the stack's ClickHouse cluster, which test_clickhouse_cluster.py drops,
#: truncates and stops: one after another with it, on one worker.
pytestmark = pytest.mark.xdist_group("clickhouse-cluster")

# --- the embedded engine keeps serving readers ------------------------------------------------


def test_readers_are_answered_while_a_continuous_loader_owns_the_embedded_folder(
    chdb_folder_url: str,
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    pg_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tried, while one `pin devstats load` process owns the chdb folder: `pin devstats labels`
    (another process), the drift asset and the versions check (Dagster, in this process), the
    freshness check's and the metrics exporter's reads (Kafka: they never open ClickHouse),
    each between batches of events produced meanwhile. Every reader answers with what the loader
    has stored, and the loader keeps loading (each new batch visible within a few seconds)."""
    env = loader_env(chdb_folder_url, kafka_bootstrap, pg_dsn, tmp_path)
    monkeypatch.setenv("PIN_CLICKHOUSE_URL", chdb_folder_url)
    settings = Settings.from_env()
    developer = uuid.uuid4()
    with loaders(loader_options, env, tmp_path) as start:
        loader = start("loader")
        first = Group(developer_id=developer)
        produce_events(kafka_bootstrap, loader_options.topic, [first.event(1)])
        wait_for("the first event loaded", lambda: versions(chdb_folder_url, [first]) != {}, 60)

        def readers_answer(group: Group) -> None:
            """The readers, one after another, then a new event: visible within seconds."""
            shown = run_pin(
                "devstats",
                "labels",
                "--developer-id",
                str(developer),
                "--ids",
                str(group.id),
                env=env,
            )
            assert summary(shown) == {str(group.id): group.event(1)["Name"]}
            drift = dg.materialize([dim_layout_group_drift], resources=RESOURCES)
            assert drift.success
            [materialized] = drift.asset_materializations_for_node("dim_layout_group_drift")
            checked = materialized.metadata["dim_rows_checked"].value
            assert isinstance(checked, int) and checked >= 1
            check_job = defs.resolve_job_def("dim_layout_group_versions_check_job")
            assert check_job.execute_in_process().success
            lag = unloaded_events(settings, topic=loader_options.topic, group=loader_options.group)
            assert lag.events == 0
            families = devstats_metrics.families(
                devstats_metrics.read_kafka_state(
                    settings,
                    topic=loader_options.topic,
                    group=loader_options.group,
                    dlq_topic=loader_options.dlq_topic,
                )
            )
            consumed = next(f for f in families if f.name == "devstats_loader_consumed")
            assert sum(sample.value for sample in consumed.samples) >= 1

        def stored(group: Group) -> bool:
            return versions(chdb_folder_url, [group]) != {}

        readers_answer(first)
        for _ in range(3):
            group = Group(developer_id=developer)
            produce_events(kafka_bootstrap, loader_options.topic, [group.event(1)])
            took = wait_for("a new event loaded", functools.partial(stored, group), 10)
            assert took < 5
            readers_answer(group)
        report, _ = loader.stop()
    assert report["inserted"] == 4 and report["consumed"] == 4
    assert report["freshness_p99_seconds"] is not None


# --- a clean stop ---------------------------------------------------------------------------


def test_sigterm_stores_and_commits_the_batch_in_hand_and_exits_0(
    chdb_folder_url: str,
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    """Tried: a loader started with SIGTERM and SIGINT ignored (its handlers are installed all
    the same), events visible within a few seconds, then 2,000 events in one go and SIGTERM
    right after them. It exits 0 within seconds with its JSON summary as the last stdout line;
    what it consumed is exactly what it committed (the batch in hand included); a second loader
    loads the rest and a version more, and the dimension ends with every group's last one."""
    env = loader_env(chdb_folder_url, kafka_bootstrap, pg_dsn, tmp_path)
    groups = [Group() for _ in range(100)]
    with loaders(loader_options, env, tmp_path) as start:
        loader = start("first", deaf=True)
        produce_events(kafka_bootstrap, loader_options.topic, [g.event(1) for g in groups])
        took = wait_for(
            "the first events loaded", lambda: len(versions(chdb_folder_url, groups)) == 100, 60
        )
        produce_events(
            kafka_bootstrap,
            loader_options.topic,
            [g.event(v) for v in range(2, 22) for g in groups],
        )
        report, stopped_in = loader.stop()
        assert stopped_in < 5
        offsets = committed(kafka_bootstrap, loader_options.topic, loader_options.group)
        assert report["consumed"] == sum(max(o, 0) for o in offsets.values())

        rest = start("second")  # and one more version each, so it is seen loading
        produce_events(kafka_bootstrap, loader_options.topic, [g.event(22) for g in groups])
        last = {g.id: 22 for g in groups}
        wait_for("the rest loaded", lambda: versions(chdb_folder_url, groups) == last, 60)
        report_rest, _ = rest.stop()
    assert report["consumed"] + report_rest["consumed"] == 2200
    ends = end_offsets(kafka_bootstrap, loader_options.topic)
    assert committed(kafka_bootstrap, loader_options.topic, loader_options.group) == ends
    assert took < 60


# --- hand-over: two loaders overlapping while events flow -------------------------------------


@pytest.fixture(params=["embedded", "server", "cluster"])
def handover_env(
    request: pytest.FixtureRequest, tmp_path: Path, pg_dsn: str, kafka_bootstrap: str
) -> dict[str, str]:
    """The loaders' settings on the embedded folder of this test, the shared server, or the
    stack's local cluster with PIN_CLICKHOUSE_CLUSTER set as a cluster deployment has it (the
    Distributed dimension); on the shared ones the groups are this test's own."""
    if request.param == "embedded":
        url = f"chdb://{tmp_path / 'chdb'}"
        summary(run_pin("db", "migrate", env={"PIN_CLICKHOUSE_URL": url}))
    else:
        url = engine_url(request)
    env = loader_env(url, kafka_bootstrap, pg_dsn, tmp_path)
    if request.param == "cluster":
        env["PIN_CLICKHOUSE_CLUSTER"] = DEFAULT_CLUSTER
    return env


def test_two_loaders_hand_over_while_events_flow_without_loss_or_reordering(
    handover_env: dict[str, str],
    loader_options: LoadOptions,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    """Tried: 20 groups get versions 1, 2, 3, … produced continuously (a few thousand events over
    ~12 s) while loader A runs, loader B starts beside it (they split the partitions), A stops
    (SIGTERM) and B goes on alone; on chdb B first sends its statements to A, then takes the
    folder over; on the cluster both insert through the Distributed table. A reader polls the
    dimension throughout. The dimension ends exact (every group's argMax version is its last), no
    reader ever saw a group's version go back, every offset is committed, both loaders exit 0
    within seconds of SIGTERM, and together they inserted every group's last version."""
    env = handover_env
    handover_url = env["PIN_CLICKHOUSE_URL"]
    groups = [Group() for _ in range(20)]
    last = dict.fromkeys((g.id for g in groups), 0)
    seen: dict[uuid.UUID, int] = {}
    regressions: list[str] = []
    producing = threading.Event()
    producing.set()

    def produce() -> None:
        """A version of every group each round, keyed by Id like the relay's events."""
        producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
        version = 0
        while producing.is_set():
            version += 1
            for g in groups:
                event = g.event(version)
                producer.produce(loader_options.topic, json.dumps(event).encode(), event["Id"])
            assert producer.flush(15) == 0
            for g in groups:
                last[g.id] = version
            time.sleep(0.04)

    def read_on() -> None:
        while producing.is_set():
            try:
                now = versions(handover_url, groups)
            except Exception as exc:  # a reader that fails is the finding
                regressions.append(f"read failed: {exc}")
                return
            for gid, version in now.items():
                if version < seen.get(gid, 0):
                    regressions.append(f"{gid}: {seen[gid]} then {version}")
                seen[gid] = max(version, seen.get(gid, 0))
            time.sleep(0.1)

    with loaders(loader_options, env, tmp_path) as start:
        first = start("a")
        producer = threading.Thread(target=produce)
        producer.start()
        try:
            wait_for("loader A loading", lambda: versions(handover_url, groups) != {}, 60)
            reader = threading.Thread(target=read_on)
            reader.start()
            time.sleep(3)
            second = start("b")
            time.sleep(5)  # both in the group
            report_a, took_a = first.stop()
            time.sleep(4)  # B alone
        finally:
            producing.clear()
            producer.join()
        reader.join()
        wait_for(
            "the last versions loaded",
            lambda: versions(handover_url, groups) == last,
            30,
        )
        report_b, took_b = second.stop()
    assert not regressions, regressions[:5]
    assert took_a < 10 and took_b < 10
    assert report_a["inserted"] > 0 and report_b["inserted"] > 0
    produced = sum(last.values())
    assert produced >= 1000
    assert report_a["consumed"] + report_b["consumed"] >= produced
    ends = end_offsets(kafka_bootstrap, loader_options.topic)
    assert committed(kafka_bootstrap, loader_options.topic, loader_options.group) == ends
