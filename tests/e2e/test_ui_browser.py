"""The on-call path through the Dagster UI, in a real browser.

A dagster-daemon and dagster-webserver run on an instance of this test alone (the repository's
dagster.yaml, its own storage database and embedded ClickHouse folder). Headless Chromium opens the
reconciliation assets' upstream lineage and saves screenshots under test-artifacts/; the
materialization is launched through the webserver's GraphQL API, as the UI's Materialize button
does, and its check verdicts are read back. A failed drain run is re-executed the way the UI's
Re-execute button does it. A missing service or browser fails the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from playwright.sync_api import Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from pin_pipelines.config import SOURCE_ROOT, Settings, dagster_pg_url_from, dsn_with_dbname
from pin_pipelines.serve import prepare_dagster_home
from pin_pipelines.stack.process import free_port
from pin_pipelines.sweeper import members, sweep
from tests.support.chessboard import make_building, make_object, make_project
from tests.support.pg import dbname
from tests.support.recalc import drain_until_empty

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = SOURCE_ROOT / "test-artifacts"
LOCATION = "pin_pipelines"
#: Served once the webserver's asset graph is loaded (the location shows as loaded earlier).
PROBE = "dim_layout_group_drift"
#: After the daemon and the webserver exit, what they started (their code servers, the daemon's
#: run workers, in their process groups) gets this long to end before it is killed.
CHILDREN_END_SECONDS = 15.0
CHECKS = {
    "aggregates_drift": "aggregates_consistent",
    "dim_layout_group_drift": "dim_layout_group_in_sync",
}

LAUNCH = """
mutation Launch($params: ExecutionParams!) {
  launchPipelineExecution(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on InvalidSubsetError { message }
  }
}"""
RUN_STATUS = "query Status($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }"
CHECK_RESULTS = """
query Checks($key: AssetKeyInput!, $check: String!) {
  assetCheckExecutions(assetKey: $key, checkName: $check, limit: 20) {
    runId status evaluation { success severity description }
  }
}"""
ASSET_DEPS = """
query Deps($key: AssetKeyInput!) {
  assetNodeOrError(assetKey: $key) {
    __typename ... on AssetNode { dependencyKeys { path } }
  }
}"""
REPOSITORY = {"repositoryLocationName": LOCATION, "repositoryName": "__repository__"}
AUTOMATION = """
query Automation($repo: RepositorySelector!) {
  sensorsOrError(repositorySelector: $repo) { ... on Sensors { results { id name } } }
  schedulesOrError(repositorySelector: $repo) { ... on Schedules { results { id name } } }
}"""
STOP_SENSOR = "mutation Stop($id: String!) { stopSensor(id: $id) { __typename } }"
STOP_SCHEDULE = "mutation Stop($id: String!) { stopRunningSchedule(id: $id) { __typename } }"
LOCATION_STATUS = """
{ workspaceOrError { ... on Workspace { locationEntries { name
    locationOrLoadError { __typename } } } } }"""


class Dagster:
    """The webserver's HTTP and GraphQL endpoints."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def gql(self, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}/graphql",
            json.dumps({"query": query, "variables": variables or {}}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            body = json.load(response)
        assert "errors" not in body, body["errors"]
        return dict(body["data"])

    def asset_node(self, asset: str) -> dict[str, Any] | None:
        found = self.gql(ASSET_DEPS, {"key": {"path": [asset]}})["assetNodeOrError"]
        return dict(found) if found["__typename"] == "AssetNode" else None

    def stop_automation(self) -> list[str]:
        """Sensors and schedules ship running; on this throwaway instance they would consume the
        shared broker's topics under the real consumer group. Stopped before the daemon starts."""
        found = self.gql(AUTOMATION, {"repo": REPOSITORY})
        stopped = []
        for kind, mutation in (
            ("sensorsOrError", STOP_SENSOR),
            ("schedulesOrError", STOP_SCHEDULE),
        ):
            for item in found[kind]["results"]:
                self.gql(mutation, {"id": item["id"]})
                stopped.append(item["name"])
        return stopped

    def wait_until_loaded(self, processes: list[subprocess.Popen[bytes]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p.args for p in processes if p.poll() is not None]
            assert not dead, f"exited early: {dead}"
            try:
                entries = self.gql(LOCATION_STATUS)["workspaceOrError"]["locationEntries"]
            except OSError:
                time.sleep(0.5)
                continue
            kinds = {e["name"]: (e["locationOrLoadError"] or {}).get("__typename") for e in entries}
            assert kinds.get(LOCATION) != "PythonError", kinds
            if kinds.get(LOCATION) == "RepositoryLocation" and self.asset_node(PROBE) is not None:
                return
            time.sleep(0.5)
        raise AssertionError(f"{self.url} did not load {LOCATION} within {timeout:.0f}s")


@pytest.fixture
def dagster(pg_dsn: str, tmp_path: Path) -> Iterator[Dagster]:
    """Webserver, then the daemon (the QueuedRunCoordinator of dagster.yaml needs it to start
    runs) once the shipped sensors and schedules are stopped on this instance.

    Each in a process group of its own, which its code server and run workers share: the stop
    ends the whole group, not only the two. A daemon stopped alone left its code server behind,
    re-parented to init, still waiting for the run worker of the test's last run to exit; the
    next test's setup then dropped the storage database under it, the code server's cleanup
    thread died on the missing database (Dagster 1.13's `_check_for_orphaned_runs`), and the
    code server, told to shut down but never terminated, outlived the CI run."""
    storage = f"{dbname(pg_dsn)}_dagster"
    with psycopg.connect(dsn_with_dbname(pg_dsn, "postgres"), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{storage}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{storage}"')
    settings = Settings.from_env(
        {
            "PIN_PG_DSN": pg_dsn,
            "PIN_STATE_DIR": str(tmp_path / "state"),
            "PIN_CLICKHOUSE_URL": f"chdb://{tmp_path / 'chdb'}",
            "PIN_DAGSTER_PG_URL": dagster_pg_url_from(pg_dsn, storage),
        }
    )
    env = prepare_dagster_home(settings)
    # The run processes open this chdb folder; this process must not hold it, so a child migrates.
    subprocess.run(
        [sys.executable, "-m", "pin_pipelines.cli", "db", "migrate"],
        env=env,
        check=True,
        cwd=SOURCE_ROOT,
        capture_output=True,
    )
    port = free_port()
    workspace = str(SOURCE_ROOT / "workspace.yaml")
    bin_dir = Path(sys.executable).parent
    logs = tmp_path / "logs"
    logs.mkdir()
    webserver = [str(bin_dir / "dagster-webserver"), "-w", workspace, "-h", "127.0.0.1"]
    processes = [
        subprocess.Popen(
            [*webserver, "-p", str(port)],
            env=env,
            cwd=SOURCE_ROOT,
            stdout=(logs / "webserver.log").open("wb"),
            stderr=subprocess.STDOUT,
            process_group=0,
        )
    ]
    try:
        server = Dagster(port)
        server.wait_until_loaded(processes, timeout=120)
        assert "recalc_queue_sensor" in server.stop_automation()
        processes.append(
            subprocess.Popen(
                [str(bin_dir / "dagster-daemon"), "run", "-w", workspace],
                env=env,
                cwd=SOURCE_ROOT,
                stdout=(logs / "daemon.log").open("wb"),
                stderr=subprocess.STDOUT,
                process_group=0,
            )
        )
        yield server
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        # Told to shut down by their parents, the code servers end once their run workers have.
        groups, session = {p.pid for p in processes}, os.getsid(0)
        deadline = time.monotonic() + CHILDREN_END_SECONDS
        while members(groups, session) and time.monotonic() < deadline:
            time.sleep(0.2)
        killed = sweep(groups, session)
        if killed:
            print(f"killed after {CHILDREN_END_SECONDS:g}s: {killed}")


def open_lineage(page: Page, base: str, asset: str) -> None:
    page.goto(f"{base}/assets/{asset}?view=lineage&lineageScope=upstream&lineageDepth=10")
    skip = page.get_by_role("button", name="Skip")  # the first-visit newsletter dialog
    with contextlib.suppress(PlaywrightTimeout):  # shown once per browser profile
        skip.click(timeout=5000)
    page.get_by_text("property_objects", exact=True).first.wait_for(timeout=30_000)
    whole = page.get_by_role(
        "button", name="All", exact=True
    )  # graph depth: the whole upstream lineage
    if whole.is_enabled():  # disabled when the default depth already shows everything
        whole.click()


def visible(page: Page, name: str) -> bool:
    """Waits: the graph lays itself out again after the depth changes."""
    try:
        page.get_by_text(name, exact=True).first.wait_for(state="visible", timeout=15_000)
    except PlaywrightTimeout:
        return False
    return True


def test_on_call_finds_drift_assets_in_the_graph_and_launches_the_check(
    db: psycopg.Connection, dagster: Dagster
) -> None:
    # One project whose stored counter was overwritten behind the recalc's back.
    project = make_project(db)
    make_object(db, project, make_building(db, project), None, status="Free", price=5)
    db.execute("DELETE FROM chessboard.project_recalc_requests")

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            # Declared lineage: the dimension and the aggregates are upstream of the drift asset.
            node = dagster.asset_node("dim_layout_group_drift")
            assert node is not None
            upstream = {"/".join(k["path"]) for k in node["dependencyKeys"]}
            assert upstream == {"dim_layout_group", "chessboard/aggregates"}

            open_lineage(page, dagster.url, "dim_layout_group_drift")
            page.screenshot(path=str(ARTIFACTS / "reconcile_dim_lineage.png"))
            # sources → aggregates → Kafka topic → dim_layout_group → drift asset
            for name in ("dim_layout_group_drift", "aggregates", "property_objects"):
                assert visible(page, name), name
            # Node labels are shortened when the whole graph fits (layou…_upserted_v1); the
            # groups' headers are not.
            for name in ("dim_layout_group", "chessboard", "kafka", "dev_stats", "reconcile"):
                assert visible(page, name), name

            open_lineage(page, dagster.url, "aggregates_drift")
            page.screenshot(path=str(ARTIFACTS / "reconcile_aggregates_lineage.png"))
            for name in ("aggregates_drift", "aggregates", "buildings", "layouts"):
                assert visible(page, name), name

            keys = [{"path": [asset]} for asset in CHECKS]
            params = {
                "selector": {
                    **REPOSITORY,
                    "jobName": "reconcile_job",
                    "assetSelection": keys,
                    "assetCheckSelection": [
                        {"assetKey": {"path": [asset]}, "name": check}
                        for asset, check in CHECKS.items()
                    ],
                },
                "runConfigData": {"ops": {"aggregates_drift": {"config": {"repair": False}}}},
                "mode": "default",
            }
            launched = dagster.gql(LAUNCH, {"params": params})["launchPipelineExecution"]
            assert launched["__typename"] == "LaunchRunSuccess", launched
            run_id = launched["run"]["runId"]
            status = None
            for _ in range(180):
                status = dagster.gql(RUN_STATUS, {"id": run_id})["runOrError"]["status"]
                if status in ("SUCCESS", "FAILURE", "CANCELED"):
                    break
                time.sleep(1)
            assert status == "SUCCESS", status

            # This run's verdicts (the hourly schedule may have run the checks meanwhile).
            verdicts = {
                check: next(
                    e
                    for e in dagster.gql(CHECK_RESULTS, {"key": {"path": [asset]}, "check": check})[
                        "assetCheckExecutions"
                    ]
                    if e["runId"] == run_id
                )
                for asset, check in CHECKS.items()
            }
            aggregates = verdicts["aggregates_consistent"]
            assert aggregates["status"] == "FAILED"
            assert aggregates["evaluation"]["severity"] == "ERROR"
            assert "nothing will recalc" in aggregates["evaluation"]["description"]
            # The dimension is empty: the project's group-less hierarchy needs no row there.
            assert verdicts["dim_layout_group_in_sync"]["status"] == "SUCCEEDED"

            # What on-call sees next: the check's verdict on the asset's Checks tab.
            page.goto(f"{dagster.url}/assets/aggregates_drift?view=checks")
            page.get_by_text("aggregates_consistent").first.wait_for(timeout=30_000)
            page.get_by_text("nothing will recalc").first.wait_for(timeout=30_000)
            page.screenshot(path=str(ARTIFACTS / "reconcile_check_failed.png"))
        finally:
            browser.close()


REEXECUTE = """
mutation Reexecute($params: ReexecutionParams!) {
  launchRunReexecution(reexecutionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
  }
}"""
RUN = """
query Run($id: ID!) {
  runOrError(runId: $id) { ... on Run { status jobName parentRunId rootRunId } }
}"""


def finished(dagster: Dagster, run_id: str, timeout: float = 180) -> dict[str, Any]:
    """The run once it has ended (success, failure or cancel)."""
    deadline = time.monotonic() + timeout
    while True:
        run = dict(dagster.gql(RUN, {"id": run_id})["runOrError"])
        if run["status"] in ("SUCCESS", "FAILURE", "CANCELED") or time.monotonic() > deadline:
            return run
        time.sleep(0.5)


def _rerun_from_failure(dagster: Dagster, failed: str, job: str) -> None:
    """The failed run re-executed as the UI's Re-execute button does (launchRunReexecution, from
    failure): the new run is the failed one's child and succeeds."""
    again = dagster.gql(REEXECUTE, {"params": {"parentRunId": failed, "strategy": "FROM_FAILURE"}})[
        "launchRunReexecution"
    ]
    assert again["__typename"] == "LaunchRunSuccess", again
    rerun = finished(dagster, again["run"]["runId"])
    assert rerun == {
        "status": "SUCCESS",
        "jobName": job,
        "parentRunId": failed,
        "rootRunId": failed,
    }


def _failed_run(dagster: Dagster, job: str, op: str, config: dict[str, Any]) -> str:
    """A run of `job` launched through the webserver that ends FAILURE; its id."""
    params = {
        "selector": {**REPOSITORY, "jobName": job},
        "runConfigData": {"ops": {op: {"config": config}}},
        "mode": "default",
    }
    launched = dagster.gql(LAUNCH, {"params": params})["launchPipelineExecution"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    failed = str(launched["run"]["runId"])
    assert finished(dagster, failed)["status"] == "FAILURE"
    return failed


def test_a_failed_drain_run_is_rerun_from_the_ui(db: psycopg.Connection, dagster: Dagster) -> None:
    """On-call's rerun: a drain run that failed is re-executed from the UI (its Re-execute
    button: the webserver's launchRunReexecution, from failure) once the cause is fixed.
    Tried: one due project, and the drain's procedure renamed away (a broken deploy): the
    recalc_drain_job run launched through the webserver fails and the row stays queued; the
    procedure back, the failed run re-executed through GraphQL: the new run is the failed
    one's child, succeeds and drains the project. Broken on purpose (the procedure left
    renamed): the re-execution failed too and this test with it."""
    project = make_project(db)
    make_object(db, project, make_building(db, project), None, status="Free", price=5)
    db.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
    db.execute("ALTER PROCEDURE chessboard.recalc_tick RENAME TO recalc_tick_gone")
    try:
        failed = _failed_run(
            dagster, "recalc_drain_job", "drain_recalc_queue", {"budget_seconds": 5.0}
        )
    finally:
        db.execute("ALTER PROCEDURE chessboard.recalc_tick_gone RENAME TO recalc_tick")
    queued = "SELECT count(*) FROM chessboard.project_recalc_requests WHERE project_id = %s"
    assert db.execute(queued, (project,)).fetchone() == (1,)
    _rerun_from_failure(dagster, failed, "recalc_drain_job")
    assert db.execute(queued, (project,)).fetchone() == (0,)


def test_a_failed_relay_run_is_rerun_from_the_ui(
    db: psycopg.Connection, pg_dsn: str, dagster: Dagster
) -> None:
    """The same for the outbox relay: a recalculated project's events wait in the outbox, and
    the relay's receipts table is renamed away (a broken deploy): the outbox_relay_job run
    launched through the webserver fails and publishes nothing; the table back, the failed run
    re-executed through GraphQL succeeds as the failed one's child and empties the outbox.
    Broken on purpose (the table left renamed): the re-execution failed too."""
    project = make_project(db)
    make_object(db, project, make_building(db, project), None, status="Free", price=5)
    drain_until_empty(db, pg_dsn)
    waiting = "SELECT count(*) FROM chessboard.outbox_events"
    pending = db.execute(waiting).fetchone()
    assert pending is not None and pending[0] >= 1
    db.execute("ALTER TABLE chessboard.outbox_relay_commits RENAME TO outbox_relay_commits_gone")
    try:
        failed = _failed_run(dagster, "outbox_relay_job", "relay_outbox", {"budget_seconds": 2.0})
    finally:
        db.execute(
            "ALTER TABLE chessboard.outbox_relay_commits_gone RENAME TO outbox_relay_commits"
        )
    assert db.execute(waiting).fetchone() == pending
    _rerun_from_failure(dagster, failed, "outbox_relay_job")
    assert db.execute(waiting).fetchone() == (0,)


def test_a_failed_load_run_is_rerun_from_the_ui(dagster: Dagster, tmp_path: Path) -> None:
    """The same for the dimension's load: the embedded ClickHouse folder replaced by a file (a
    volume lost), the dim_layout_group_job run launched through the webserver fails; the folder
    back, the failed run re-executed through GraphQL succeeds as the failed one's child.
    Broken on purpose (the folder left a file): the re-execution failed too."""
    folder = tmp_path / "chdb"
    moved = tmp_path / "chdb_moved"
    folder.rename(moved)
    folder.write_text("not a ClickHouse folder\n")
    try:
        failed = _failed_run(
            dagster, "dim_layout_group_job", "dim_layout_group", {"budget_seconds": 2.0}
        )
    finally:
        folder.unlink()
        moved.rename(folder)
    _rerun_from_failure(dagster, failed, "dim_layout_group_job")
