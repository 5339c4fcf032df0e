"""The event contracts (pin_pipelines/contracts) and the database: the relay's gate requires what
each contract requires, and the payloads the drain's SQL builds keep their contracts, nulls
included (every other drain test checks its payloads too: tests.support.recalc.outbox)."""

from __future__ import annotations

import psycopg

from pin_pipelines.contracts import contract_topics, required_fields
from pin_pipelines.kafka import TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP, TOPIC_PROJECT
from tests.support.chessboard import (
    make_building,
    make_layout,
    make_layout_group,
    make_object,
    make_project,
    small_project,
)
from tests.support.contracts import violations
from tests.support.recalc import drain_due, outbox


def test_the_relays_gate_requires_what_each_contract_requires(db: psycopg.Connection) -> None:
    """Tried: chessboard.outbox_topics, the topics the relay publishes and the fields it
    requires of each payload (else a dead letter), against the contracts' `required`. The
    worker's database is shared by its modules, and some register a private topic of their
    own (`pin.test.…`, a copy of a product topic's row, left there): every other topic is the
    product's and has its contract."""
    rows = db.execute("SELECT topic, required_fields FROM chessboard.outbox_topics")
    gate = {topic: fields for topic, fields in rows if not topic.startswith(TEST_TOPICS)}
    assert gate == {topic: required_fields(topic) for topic in contract_topics()}


#: The prefix of the topics tests register with the relay for themselves (loader_options).
TEST_TOPICS = "pin.test."


def test_the_payloads_the_drain_builds_keep_their_contracts(
    pg_dsn: str, db: psycopg.Connection
) -> None:
    """Tried: a project with every kind of row (small_project), and one whose bounds are all
    null: no priced object, a group with no layout, a layout in no group. Drained, every
    snapshot event of the three topics keeps its contract."""
    small_project(db)
    bare = make_project(db, status="Draft")
    building = make_building(db, bare)
    make_layout_group(db, bare, "Пустая")
    loose = make_layout(db, bare, None, 40)
    make_object(db, bare, building, loose, status="Sold", price=0)
    drain_due(pg_dsn, db)
    events = outbox(db)
    assert {topic for topic, _, _ in events} == {TOPIC_PROJECT, TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP}
    assert [(t, violations(t, payload)) for t, _, payload in events if violations(t, payload)] == []
    nulls = {field for _, _, payload in events for field, value in payload.items() if value is None}
    assert {"AreaMin", "AreaMax", "LayoutGroupId"} <= nulls
