"""Spec 003's reads of dim_layout_group on both ClickHouse engines: scoped by developer
and, optionally, project (`WHERE DeveloperId = actor AND ProjectId = … AND LayoutGroupId = …`),
and the current row of a group whose two versions share an UpsertedAt.

Rows go in through the loader's own write (`insert_events`), one insert per version as the loader
does; the groups are fresh UUIDs, so the shared server's table needs no cleaning.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest

from pin_pipelines.clickhouse import ClickHouse, migrate_clickhouse, open_clickhouse
from pin_pipelines.clickhouse.url import ServerAddress, parse_clickhouse_url
from pin_pipelines.devstats.dim import QUERIES, groups, insert_events, labels, stored_versions
from pin_pipelines.devstats.events import parse_event
from tests.support.answer_cutter import AnswerCutter
from tests.support.api import api_client
from tests.support.cli import run_pin, summary
from tests.support.clickhouse import optimize_dimension, server_url
from tests.support.devstats import BASE_TIME, Group, physical_rows
from tests.support.idp import IdentityProvider

GROUPS, LABELS = "/v1/layout-groups", "/v1/layout-groups/labels"

TABLE = "pin_dev_stats.dim_layout_group"


def store(ch: ClickHouse, group: Group, version: int, **overrides: Any) -> None:
    """One version of `group` written as the loader writes it (`overrides` as in Group.event)."""
    insert_events(ch, [parse_event(json.dumps(group.event(version, **overrides)).encode())])


def iso(moment: datetime) -> str:
    """An event's CreatedAt: ISO-8601 UTC with milliseconds."""
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --- project scope ----------------------------------------------------------------------------


def test_labels_and_groups_filter_the_project_of_the_current_row(clickhouse: ClickHouse) -> None:
    """One developer with groups in projects P and Q, plus another developer's group in P.
    Tried: labels and groups with project P, with project Q and without a project. A group of
    Q, another developer's group and a missing id are labelled with their id under P; a group
    whose NEWEST row moved it from P to Q counts as Q's (its old P row does not leak its old
    name), one moved from Q into P counts as P's."""
    developer, project_p, project_q = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    in_p = Group(developer, project_p)
    also_in_p = Group(developer, project_p)
    in_q = Group(developer, project_q)
    moved_out = Group(developer, project_p)  # v1 in P, v2 in Q
    moved_in = Group(developer, project_q)  # v1 in Q, v2 in P
    theirs = Group(project_id=project_p)
    missing = uuid.uuid4()
    store(clickhouse, in_p, 1, SortOrder=2)
    store(clickhouse, also_in_p, 1, SortOrder=1)
    store(clickhouse, in_q, 1)
    store(clickhouse, moved_out, 1)
    store(clickhouse, moved_out, 2, ProjectId=str(project_q))
    store(clickhouse, moved_in, 1)
    store(clickhouse, moved_in, 2, ProjectId=str(project_p), SortOrder=3)
    store(clickhouse, theirs, 1)
    ids = [in_p.id, also_in_p.id, in_q.id, moved_out.id, moved_in.id, theirs.id, missing]

    assert labels(clickhouse, developer, ids, project_p) == {
        str(in_p.id): "Студии v1",
        str(also_in_p.id): "Студии v1",
        str(in_q.id): str(in_q.id),  # another project: the id, like a missing row
        str(moved_out.id): str(moved_out.id),  # its current row is in Q
        str(moved_in.id): "Студии v2",
        str(theirs.id): str(theirs.id),  # another developer, even in the same project
        str(missing): str(missing),
    }
    assert labels(clickhouse, developer, ids, project_q) == {
        **{str(gid): str(gid) for gid in ids},
        str(in_q.id): "Студии v1",
        str(moved_out.id): "Студии v2",
    }
    assert labels(clickhouse, developer, ids) == {
        **{str(gid): str(gid) for gid in (theirs.id, missing)},
        str(in_p.id): "Студии v1",
        str(also_in_p.id): "Студии v1",
        str(in_q.id): "Студии v1",
        str(moved_out.id): "Студии v2",
        str(moved_in.id): "Студии v2",
    }

    in_project_p = groups(clickhouse, developer, project_p)
    assert [g.layout_group_id for g in in_project_p] == [also_in_p.id, in_p.id, moved_in.id]
    assert {g.project_id for g in in_project_p} == {project_p}
    assert [g.layout_group_id for g in groups(clickhouse, developer, project_q)] == [
        in_q.id,  # SortOrder 10
        moved_out.id,  # SortOrder 20 (its v2)
    ]
    assert len(groups(clickhouse, developer)) == 5
    assert groups(clickhouse, theirs.developer_id, project_q) == []


def test_cli_labels_take_a_project_id(clickhouse_server_url: str) -> None:
    """`pin devstats labels --developer-id D --ids A,B --project-id P` as a user runs it (on the
    Debian server, which a subprocess can share with this one): A in P gets its name, B of
    another project of D its id; without --project-id both get their names."""
    developer, project = uuid.uuid4(), uuid.uuid4()
    mine, elsewhere = Group(developer, project), Group(developer)
    with open_clickhouse(clickhouse_server_url) as ch:
        store(ch, mine, 1)
        store(ch, elsewhere, 1, Name="Люкс с видом на море")
    args = [
        "devstats",
        "labels",
        "--developer-id",
        str(developer),
        "--ids",
        f"{mine.id},{elsewhere.id}",
    ]
    env = {"PIN_CLICKHOUSE_URL": clickhouse_server_url}

    assert summary(run_pin(*args, "--project-id", str(project), env=env)) == {
        str(mine.id): "Студии v1",
        str(elsewhere.id): str(elsewhere.id),
    }
    assert summary(run_pin(*args, env=env)) == {
        str(mine.id): "Студии v1",
        str(elsewhere.id): "Люкс с видом на море",
    }


# --- UpsertedAt ties --------------------------------------------------------------------------


@pytest.fixture(params=["embedded", "server"])
def unmerged_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A migrated dimension whose background merges are stopped while the test runs, so two
    rows of one group stay two rows while it reads them (a merge would keep one and hide the
    tie): the session's embedded engine, or a private Debian 18.16 server (the shared server's
    merges are not ours to stop)."""
    if request.param == "embedded":
        url = str(request.getfixturevalue("chdb_url"))
    else:
        url = server_url(request.getfixturevalue("private_clickhouse_server"))
    with open_clickhouse(url) as ch:
        migrate_clickhouse(ch)
        ch.command(f"SYSTEM STOP MERGES {TABLE}")
        try:
            yield url
        finally:
            ch.command(f"SYSTEM START MERGES {TABLE}")


@pytest.fixture
def unmerged(unmerged_url: str) -> Iterator[ClickHouse]:
    with open_clickhouse(unmerged_url) as ch:
        yield ch


@pytest.mark.parametrize("order", [(1, 2), (2, 1)], ids=["loader-order", "reversed"])
@pytest.mark.parametrize(
    ("v1_at", "v2_at"),
    [
        pytest.param(BASE_TIME, BASE_TIME, id="same-millisecond"),
        pytest.param(
            BASE_TIME + timedelta(milliseconds=100),
            BASE_TIME + timedelta(milliseconds=900),
            id="same-second",  # a tie on 18.16 only, whose UpsertedAt is a DateTime
        ),
    ],
)
def test_the_higher_source_version_wins_a_tie_in_every_read(
    unmerged: ClickHouse, v1_at: datetime, v2_at: datetime, order: tuple[int, int]
) -> None:
    """Versions 1 and 2 of one group stamped in the same millisecond (a tie on both engines),
    or 100 and 900 ms into the same second (a tie where UpsertedAt has whole seconds), stored
    by two inserts: in the loader's order (its version guard never lets an older version follow
    a newer one), and reversed (a writer racing the guard). Tried: every read of the dimension
    (labels, groups, current_rows, the loader's stored_versions) while both rows are stored.
    Each returns version 2. Without the SourceVersion tie-break, the row argMax(…, UpsertedAt)
    returns depends on the order it happens to read the parts in: version 1 in some cases of
    every run."""
    group = Group()
    versions = {
        1: {"CreatedAt": iso(v1_at), "SortOrder": 1},
        2: {"CreatedAt": iso(v2_at), "SortOrder": 2, "IsArchived": True},
    }
    for version in order:
        store(unmerged, group, version, **versions[version])

    assert labels(unmerged, group.developer_id, [group.id], group.project_id) == {
        str(group.id): "Студии v2"
    }
    [row] = groups(unmerged, group.developer_id)
    assert (row.name, row.sort_order, row.is_archived, row.source_version) == (
        "Студии v2",
        2,
        True,
        2,
    )
    current = [r for r in unmerged.rows(QUERIES["current_rows"]) if r[0] == group.id]
    assert current == [(group.id, group.project_id, group.developer_id, "Студии v2", 2, 1, 2)]
    assert stored_versions(unmerged, [group.id]) == {group.id.int: 2}
    # Both rows were there for every read above (merges are stopped): the tie was real.
    assert physical_rows(unmerged, group.id) == [(1, "Студии v1"), (2, "Студии v2")]


def test_the_latest_upserted_at_wins_before_and_after_a_merge_whatever_the_versions(
    unmerged: ClickHouse,
) -> None:
    """Spec 003: ReplacingMergeTree(UpsertedAt), max UpsertedAt wins (INV-DIM-LG-4); the
    reads must answer what the engine keeps. Tried: version 1 stamped 10 s after BASE_TIME and
    version 2 stamped 5 s after it (a producer's clock stepped back), stored in version order
    as the loader stores them, merges stopped. Before a merge both rows are stored and every
    read answers version 1 (the later UpsertedAt); after OPTIMIZE TABLE … FINAL (here only: no
    online read uses FINAL) the engine has kept version 1 alone and the reads answer the same.
    On both engines. Broken on purpose: the reads' argMax by (SourceVersion, UpsertedAt): they
    answered version 2 before the merge, failing this test (and disagreed with the merge)."""
    group = Group()
    store(unmerged, group, 1, CreatedAt=iso(BASE_TIME + timedelta(seconds=10)))
    store(unmerged, group, 2, CreatedAt=iso(BASE_TIME + timedelta(seconds=5)))

    def answers() -> tuple[dict[str, str], list[tuple[str, int]], list[tuple[object, ...]]]:
        return (
            labels(unmerged, group.developer_id, [group.id], group.project_id),
            [(g.name, g.source_version) for g in groups(unmerged, group.developer_id)],
            [r for r in unmerged.rows(QUERIES["current_rows"]) if r[0] == group.id],
        )

    expected = (
        {str(group.id): "Студии v1"},
        [("Студии v1", 1)],
        [(group.id, group.project_id, group.developer_id, "Студии v1", 10, 0, 1)],
    )
    assert physical_rows(unmerged, group.id) == [(1, "Студии v1"), (2, "Студии v2")]
    assert answers() == expected
    unmerged.command(f"SYSTEM START MERGES {TABLE}")
    optimize_dimension(unmerged)
    assert physical_rows(unmerged, group.id) == [(1, "Студии v1")]  # what the engine kept
    assert answers() == expected


# --- scope after a move -----------------------------------------------------------------------


def test_a_group_moved_to_another_developer_is_only_the_new_ones_before_any_merge(
    unmerged_url: str, unmerged: ClickHouse
) -> None:
    """Spec 003, scope: only rows with DeveloperId = actor, on the group's CURRENT row. Tried: a
    group loaded for developer A (version 1), then version 2 for developer B, merges stopped (no
    OPTIMIZE: both rows stay stored). A gets the id back as its label and no group in its list;
    B gets the name and the group, through the dimension's reads, the read API (labels with and
    without the project, the project's list) and, on the 18.16 server, `pin devstats labels`.
    Broken on purpose: with the developer filtered on raw rows again (`WHERE DeveloperId =`,
    as before), A's read found its old row alone and got "Студии v1" back, on both engines."""
    developer_a, developer_b = uuid.uuid4(), uuid.uuid4()
    group = Group(developer_a)
    store(unmerged, group, 1)
    store(unmerged, group, 2, TenantId=str(developer_b))
    assert physical_rows(unmerged, group.id) == [(1, "Студии v1"), (2, "Студии v2")]
    gid = str(group.id)

    for project in (None, group.project_id):
        assert labels(unmerged, developer_a, [group.id], project) == {gid: gid}
        assert labels(unmerged, developer_b, [group.id], project) == {gid: "Студии v2"}
        assert groups(unmerged, developer_a, project) == []
        assert [g.layout_group_id for g in groups(unmerged, developer_b, project)] == [group.id]

    with IdentityProvider() as idp, api_client(unmerged_url, idp) as api:

        def answer(developer: uuid.UUID, path: str, **params: str) -> Any:
            got = api.get(
                path, params=params, headers={"Authorization": f"Bearer {idp.token(developer)}"}
            )
            assert got.status_code == 200, got.text
            return got.json()

        in_project = {"projectId": str(group.project_id)}
        for query in ({}, in_project):
            assert answer(developer_a, LABELS, ids=gid, **query) == {"labels": {gid: gid}}
            assert answer(developer_b, LABELS, ids=gid, **query) == {"labels": {gid: "Студии v2"}}
        assert answer(developer_a, GROUPS, **in_project) == {"groups": []}
        assert [g["id"] for g in answer(developer_b, GROUPS, **in_project)["groups"]] == [gid]

    if not unmerged_url.startswith("chdb:"):  # a subprocess cannot share the embedded folder
        env = {"PIN_CLICKHOUSE_URL": unmerged_url}
        for developer, label in ((developer_a, gid), (developer_b, "Студии v2")):
            cli = run_pin(
                "devstats", "labels", "--developer-id", str(developer), "--ids", gid, env=env
            )
            assert summary(cli) == {gid: label}
    assert physical_rows(unmerged, group.id) == [(1, "Студии v1"), (2, "Студии v2")]


# --- no FINAL online -------------------------------------------------------------------------


def test_no_online_read_sends_final(clickhouse_server_url: str) -> None:
    """Spec 003: FINAL is forbidden online. Tried: every online read as it goes over the wire to
    the 18.16 server, through a loopback relay that keeps what the clients send (a query's text
    travels as it is): the dimension's reads (labels and groups, with and without a project),
    the read API (its start and /healthz, labels, the project's list) and `pin devstats labels`
    in a process of its own. Each sent the dimension's name (the reads were captured) and none
    the word FINAL. Broken on purpose: `FINAL` added after the table of the labels query; the
    test failed with "reads sent FINAL"."""
    group = Group()
    with open_clickhouse(clickhouse_server_url) as ch:
        store(ch, group, 1)
    server = parse_clickhouse_url(clickhouse_server_url)
    assert isinstance(server, ServerAddress)
    relay = AnswerCutter(server.port)
    try:
        url = clickhouse_server_url.replace(f":{server.port}/", f":{relay.port}/")

        def sent_since(mark: int) -> str:
            text = bytes(relay.sent[mark:]).decode("utf-8", "replace")
            assert TABLE in text, "nothing of the reads was captured"
            return text

        with open_clickhouse(url) as ch:
            for project in (None, group.project_id):
                labels(ch, group.developer_id, [group.id], project)
                groups(ch, group.developer_id, project)
        phases = {"reads": sent_since(0)}
        mark = len(relay.sent)
        with IdentityProvider() as idp, api_client(url, idp) as api:
            token = {"Authorization": f"Bearer {idp.token(group.developer_id)}"}
            for path, params in (
                ("/healthz", {}),
                (LABELS, {"ids": str(group.id)}),
                (GROUPS, {"projectId": str(group.project_id)}),
            ):
                assert api.get(path, params=params, headers=token).status_code == 200
        phases["read API"] = sent_since(mark)
        mark = len(relay.sent)
        cli = run_pin(
            "devstats",
            "labels",
            "--developer-id",
            str(group.developer_id),
            "--ids",
            str(group.id),
            env={"PIN_CLICKHOUSE_URL": url},
        )
        assert summary(cli) == {str(group.id): "Студии v1"}
        phases["pin devstats labels"] = sent_since(mark)
    finally:
        relay.close()
    for phase, text in phases.items():
        assert not re.search(r"\bFINAL\b", text, re.IGNORECASE), f"{phase} sent FINAL"
