"""A layout group's developer is its project's, up the hierarchy (spec 003 INV-DIM-LG-2:
`DeveloperId` = `TenantId`, "the project's DeveloperId"), whatever the writer touched: a project
passed to another developer takes its groups along, and a group moved into another developer's
project takes that developer, through the whole flow (drain → relay → loader → the reads and the
read API: the old developer reads the id, as for any other developer's group, CONTRACT section 7,
the new one the name). `layout_groups.tenant_id` is kept so by the catalogue's triggers (migration
0022), also against a concurrent writer.

Real PostgreSQL, Kafka and the embedded ClickHouse; a missing service fails these tests.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any
from uuid import UUID

import psycopg
import pytest

from pin_pipelines.clickhouse import ClickHouse
from pin_pipelines.devstats.dim import groups, labels
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP, TOPIC_PROJECT
from tests.support.api import api_client
from tests.support.chessboard import (
    make_building,
    make_layout,
    make_layout_group,
    make_object,
    make_project,
)
from tests.support.idp import IdentityProvider
from tests.support.loaders import wait_for
from tests.support.recalc import drain_until_empty, lock_waiters, outbox, queue_row

LABELS, GROUPS = "/v1/layout-groups/labels", "/v1/layout-groups"


@pytest.fixture(scope="module")
def idp() -> Iterator[IdentityProvider]:
    with IdentityProvider() as provider:
        yield provider


def group_tenants(conn: psycopg.Connection, ids: list[UUID]) -> dict[UUID, UUID]:
    return dict(
        conn.execute(
            "SELECT id, tenant_id FROM chessboard.layout_groups WHERE id = ANY(%s)", (ids,)
        ).fetchall()
    )


def assert_read_by_their_developer_only(
    db: psycopg.Connection,
    ch: ClickHouse,
    chdb_url: str,
    idp: IdentityProvider,
    ids: list[UUID],
    old: UUID,
) -> None:
    """The groups `ids`, of one project, are in the dimension as PostgreSQL has them now (project,
    name, version) under their project's developer: the dimension's reads and the read API give
    that developer the names and list them in the project, and `old` each group's id and no
    group, like any other developer's groups."""
    rows = db.execute(
        "SELECT g.id, g.project_id, p.tenant_id, g.name, g.version FROM chessboard.layout_groups g"
        " JOIN chessboard.projects p ON p.id = g.project_id WHERE g.id = ANY(%s)",
        (ids,),
    ).fetchall()
    [(project, new)] = {(project_id, tenant) for _, project_id, tenant, _, _ in rows}
    assert new != old
    as_ids = {str(g): str(g) for g in ids}
    as_names = {str(gid): name for gid, _, _, name, _ in rows}
    for in_project in (None, project):
        assert labels(ch, old, ids, in_project) == as_ids
        assert labels(ch, new, ids, in_project) == as_names
    assert groups(ch, old) == []
    listed_by_read = {
        (g.layout_group_id, g.project_id, g.source_version)
        for g in groups(ch, new, project)
        if g.layout_group_id in ids
    }
    assert listed_by_read == {(gid, project_id, version) for gid, project_id, _, _, version in rows}

    with api_client(chdb_url, idp) as api:

        def answer(developer: UUID, path: str, **params: str) -> Any:
            got = api.get(
                path, params=params, headers={"Authorization": f"Bearer {idp.token(developer)}"}
            )
            assert got.status_code == 200, got.text
            return got.json()

        wanted = ",".join(map(str, ids))
        for scope in ({}, {"projectId": str(project)}):
            assert answer(old, LABELS, ids=wanted, **scope) == {"labels": as_ids}
            assert answer(new, LABELS, ids=wanted, **scope) == {"labels": as_names}
        assert answer(old, GROUPS, projectId=str(project)) == {"groups": []}
        listed = answer(new, GROUPS, projectId=str(project))["groups"]
        assert {g["id"]: g["name"] for g in listed if g["id"] in as_names} == as_names


# --- through the whole flow ---------------------------------------------------------------------


def test_a_project_passed_to_another_developer_takes_its_groups_along(
    db: psycopg.Connection,
    ch: ClickHouse,
    chdb_url: str,
    idp: IdentityProvider,
    pipeline: Callable[[], None],
) -> None:
    """Tried: a project of developer A with a group holding a layout and an empty group, loaded
    and read as A's; then the project's tenant_id set to B, alone (no group row touched). Before
    migration 0022 the groups kept A in their row, the drain published only the project, and the
    dimension went on answering A with the names and B with the ids. Now the edit moves the
    groups' tenant_id to B in its own transaction and enqueues the project once (one request, not
    one more per group); its drain publishes the project and both groups with TenantId B and
    Version + 1, and no layout (a layout's event carries no developer); after relay and load B
    reads both names (labels, the project's list, through the reads and the read API) and A only
    the ids."""
    old, new = uuid.uuid4(), uuid.uuid4()
    project = make_project(db, tenant_id=old)
    building = make_building(db, project)
    studios = make_layout_group(db, project, "Студии")
    empty = make_layout_group(db, project, "Люкс с видом на море")
    make_object(db, project, building, make_layout(db, project, studios, Decimal(25)))
    names = {studios: "Студии", empty: "Люкс с видом на море"}
    pipeline()
    assert labels(ch, old, list(names)) == {str(g): n for g, n in names.items()}

    db.execute("UPDATE chessboard.projects SET tenant_id = %s WHERE id = %s", (new, project))
    assert group_tenants(db, list(names)) == dict.fromkeys(names, new)
    request = queue_row(db, project)
    assert request is not None
    assert (request["tenant_id"], request["requested_count"]) == (new, 1)

    drain_until_empty(db, db.info.dsn)
    published = {(topic, key): payload for topic, key, payload in outbox(db)}
    assert published.keys() == {
        (TOPIC_PROJECT, str(project)),
        *((TOPIC_LAYOUT_GROUP, str(g)) for g in names),
    }
    assert {p["TenantId"] for p in published.values()} == {str(new)}
    pipeline()

    assert_read_by_their_developer_only(db, ch, chdb_url, idp, list(names), old)


def test_a_group_moved_into_another_developers_project_takes_that_developer(
    db: psycopg.Connection,
    ch: ClickHouse,
    chdb_url: str,
    idp: IdentityProvider,
    pipeline: Callable[[], None],
) -> None:
    """Tried: developer A's project P with a group and its layout, developer B's project Q, both
    loaded; then the group's project_id set to Q (the writer leaves tenant_id as it was, the way
    an API that moves a group by its parent id writes it). Before migration 0022 the group kept
    A: its event from Q's drain said ProjectId Q with TenantId A, so B could not read the group of
    its own project and A still could. Now the move gives the row Q's developer; both projects are
    enqueued, Q's drain publishes the group with ProjectId Q and TenantId B, and after relay and
    load B reads the name (with project Q too) and A the id. A writer that names a developer
    itself is overruled: a group inserted into Q with A as tenant_id, and a later write of
    tenant_id = A, leave B in the row."""
    old, new = uuid.uuid4(), uuid.uuid4()
    project_p = make_project(db, tenant_id=old)
    project_q = make_project(db, tenant_id=new)
    group = make_layout_group(db, project_p, "Студии")
    make_layout(db, project_p, group, Decimal(31))
    make_layout_group(db, project_q, "Пентхаусы")
    pipeline()
    assert labels(ch, old, [group]) == {str(group): "Студии"}

    db.execute(
        "UPDATE chessboard.layout_groups SET project_id = %s WHERE id = %s", (project_q, group)
    )
    assert group_tenants(db, [group]) == {group: new}
    assert queue_row(db, project_p) is not None and queue_row(db, project_q) is not None

    drain_until_empty(db, db.info.dsn)
    [(_, _, event)] = outbox(db, group)
    assert (event["ProjectId"], event["TenantId"]) == (str(project_q), str(new))
    pipeline()

    assert_read_by_their_developer_only(db, ch, chdb_url, idp, [group], old)

    claimed = uuid.uuid4()
    db.execute(
        "INSERT INTO chessboard.layout_groups (id, project_id, tenant_id, name)"
        " VALUES (%s, %s, %s, 'Чужая')",
        (claimed, project_q, old),
    )
    db.execute("UPDATE chessboard.layout_groups SET tenant_id = %s WHERE id = %s", (old, group))
    assert group_tenants(db, [claimed, group]) == {claimed: new, group: new}


# --- concurrent writers -------------------------------------------------------------------------


def in_threads(*works: Callable[[], None]) -> tuple[list[threading.Thread], list[BaseException]]:
    """Each of `works` started in a thread; their exceptions land in the list."""
    failures: list[BaseException] = []

    def run(work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:  # re-raised by the test
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(work,), daemon=True) for work in works]
    for thread in threads:
        thread.start()
    return threads, failures


def finish(
    db: psycopg.Connection,
    blocker: psycopg.Connection,
    threads: list[threading.Thread],
    failures: list[BaseException],
) -> None:
    """Once every thread is done or waiting for a lock, `blocker` commits; the threads end."""
    wait_for(
        "every session done or waiting for a lock",
        lambda: lock_waiters(db) >= sum(t.is_alive() for t in threads),
        10,
    )
    blocker.commit()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads) and failures == []


def test_a_group_written_while_its_project_changes_developer_gets_the_new_one(
    db: psycopg.Connection, pg_dsn: str
) -> None:
    """Sessions of the server writing groups while another passes their project to another
    developer, in both orders. Tried:
    - the change from A to B first, uncommitted: a group inserted into the project and a group
      moved into it, each in a session of its own, wait for it (each reads the project FOR
      SHARE) and then take B;
    - a group inserted first, uncommitted: the change from B to C waits for it and then passes
      the new group to C too, with the others.
    With the project read without a lock (the foreign key's KEY SHARE does not conflict with a
    developer change), the first order left both groups with A, read before the change
    committed, and the second left the new group with B, unseen by the change's UPDATE."""
    developer_a, developer_b, developer_c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    project = make_project(db, tenant_id=developer_a)
    elsewhere = make_project(db, tenant_id=developer_a)
    moved = make_layout_group(db, elsewhere, "Перенесённая")
    inserted, late = uuid.uuid4(), uuid.uuid4()

    with (
        psycopg.connect(pg_dsn) as changer,
        psycopg.connect(pg_dsn, autocommit=True) as inserter,
        psycopg.connect(pg_dsn, autocommit=True) as mover,
    ):
        changer.execute(
            "UPDATE chessboard.projects SET tenant_id = %s WHERE id = %s", (developer_b, project)
        )
        threads, failures = in_threads(
            lambda: inserter.execute(
                "INSERT INTO chessboard.layout_groups (id, project_id, name)"
                " VALUES (%s, %s, 'Новая')",
                (inserted, project),
            ),
            lambda: mover.execute(
                "UPDATE chessboard.layout_groups SET project_id = %s WHERE id = %s",
                (project, moved),
            ),
        )
        finish(db, changer, threads, failures)
    assert group_tenants(db, [inserted, moved]) == {inserted: developer_b, moved: developer_b}

    with (
        psycopg.connect(pg_dsn) as inserter,
        psycopg.connect(pg_dsn, autocommit=True) as changer,
    ):
        inserter.execute(
            "INSERT INTO chessboard.layout_groups (id, project_id, name)"
            " VALUES (%s, %s, 'Поздняя')",
            (late, project),
        )
        threads, failures = in_threads(
            lambda: changer.execute(
                "UPDATE chessboard.projects SET tenant_id = %s WHERE id = %s",
                (developer_c, project),
            )
        )
        finish(db, inserter, threads, failures)
    assert group_tenants(db, [inserted, moved, late]) == dict.fromkeys(
        [inserted, moved, late], developer_c
    )
