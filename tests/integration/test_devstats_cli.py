"""`pin devstats load --once`, `pin devstats labels` and `pin devstats backfill` as a user runs
them (contract section 2).

The commands run in subprocesses on a chdb folder of this module (never the session's in-process
folder: chdb allows one process per folder). `load --once` consumes the contract topic with the
loader's group, so the module first commits that group to the topic's end and asserts only on the
groups it produced. A backfill would replay that whole shared topic with the loader's group, which
other tests load meanwhile: its command is tested with the replay faked (the replay itself, on a
topic of its own: test_devstats_loader.py).
"""

from __future__ import annotations

import io
import json
import uuid
from contextlib import redirect_stdout
from typing import Any

import pytest

from pin_pipelines.cli import main
from pin_pipelines.devstats import loading as loader  # what `pin devstats backfill` calls
from pin_pipelines.devstats.loading import DEFAULT_GROUP, IdRange, LoadSummary
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP, ensure_topics
from tests.support.cli import assert_one_line_error, run_pin, summary
from tests.support.devstats import Group, commit_group, end_offsets, produce_events


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory: pytest.TempPathFactory, pg_dsn: str) -> dict[str, str]:
    """A migrated chdb folder for the `pin` subprocesses (`pin db migrate`, as a user would)."""
    env = {"PIN_CLICKHOUSE_URL": f"chdb://{tmp_path_factory.mktemp('cli') / 'chdb'}"}
    summary(run_pin("db", "migrate", env=env))
    return env


@pytest.fixture(scope="module")
def loaded(cli_env: dict[str, str], kafka_bootstrap: str) -> dict[str, object]:
    """Two groups of one developer (one updated, one delivered late again) and one group of
    another developer, loaded by `pin devstats load --once`; its JSON summary."""
    ensure_topics(kafka_bootstrap, (TOPIC_LAYOUT_GROUP,))
    ends = end_offsets(kafka_bootstrap, TOPIC_LAYOUT_GROUP)
    commit_group(kafka_bootstrap, TOPIC_LAYOUT_GROUP, DEFAULT_GROUP, ends)
    mine = Group()
    theirs = Group()
    produce_events(
        kafka_bootstrap,
        TOPIC_LAYOUT_GROUP,
        [mine.event(1), mine.event(2, Name="Люкс с видом на море"), theirs.event(1), mine.event(1)],
    )
    result = run_pin("devstats", "load", "--once", env=cli_env)
    return {"summary": summary(result), "mine": mine, "theirs": theirs}


def test_load_once_prints_the_json_summary(loaded: dict[str, object]) -> None:
    report = loaded["summary"]
    assert isinstance(report, dict)
    assert {"consumed", "inserted", "skipped_stale", "dead_lettered"} <= set(report)
    # Others may publish on the shared topic meanwhile: at least our four events were read.
    assert report["consumed"] >= 4
    assert report["inserted"] >= 2
    assert report["skipped_stale"] >= 2  # v1 superseded within the batch, and the late v1
    assert report["consumed"] == (
        report["inserted"] + report["skipped_stale"] + report["dead_lettered"]
    )


def test_labels_name_the_actors_groups_and_degrade_to_the_id(
    loaded: dict[str, object], cli_env: dict[str, str]
) -> None:
    mine, theirs = loaded["mine"], loaded["theirs"]
    assert isinstance(mine, Group) and isinstance(theirs, Group)
    missing = uuid.uuid4()
    result = run_pin(
        "devstats",
        "labels",
        "--developer-id",
        str(mine.developer_id),
        "--ids",
        f"{mine.id},{missing},{theirs.id}",
        env=cli_env,
    )
    assert summary(result) == {
        str(mine.id): "Люкс с видом на море",
        str(missing): str(missing),  # no row yet: the id, no error
        str(theirs.id): str(theirs.id),  # another developer's row: invisible, like a missing one
    }
    owner = run_pin(
        "devstats",
        "labels",
        "--developer-id",
        str(theirs.developer_id),
        "--ids",
        str(theirs.id),
        env=cli_env,
    )
    assert summary(owner) == {str(theirs.id): "Студии v1"}
    assert json.loads(owner.stdout.strip().splitlines()[-1])  # one JSON object, last line


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--developer-id", "not-a-uuid", "--ids", str(uuid.uuid4())], "not-a-uuid"),
        (["--developer-id", str(uuid.uuid4()), "--ids", "a,b"], "UUID"),
    ],
)
def test_labels_reject_a_bad_argument_in_one_line(
    args: list[str], needle: str, cli_env: dict[str, str]
) -> None:
    assert_one_line_error(run_pin("devstats", "labels", *args, env=cli_env), needle)


def test_backfill_hands_its_range_to_the_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[IdRange] = []

    def replay(_settings: Any, *, ids: IdRange) -> LoadSummary:
        asked.append(ids)
        return LoadSummary(consumed=3, skipped_out_of_range=2)

    monkeypatch.setattr(loader, "backfill", replay)
    first, last = sorted(uuid.uuid4() for _ in range(2))
    argvs = [["--from-id", str(first), "--to-id", str(last)], ["--to-id", str(last)], []]
    for argv in argvs:
        out = io.StringIO()
        with redirect_stdout(out):
            assert main(["devstats", "backfill", *argv]) == 0
        report = json.loads(out.getvalue().strip().splitlines()[-1])
        assert (report["consumed"], report["skipped_out_of_range"]) == (3, 2)
    assert asked == [IdRange(first, last), IdRange(None, last), IdRange()]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--from-id", "not-a-uuid"], "not-a-uuid"),
        (["--to-id", str(uuid.UUID(int=1)), "--from-id", str(uuid.UUID(int=2))], "greater than"),
    ],
)
def test_backfill_rejects_a_bad_range_in_one_line(args: list[str], needle: str) -> None:
    """Before the replay: with Kafka unreachable, a replay would fail with another line."""
    unreachable = {"PIN_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    assert_one_line_error(run_pin("devstats", "backfill", *args, env=unreachable), needle)
