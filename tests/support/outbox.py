"""The outbox as the recalc fills it, for the relay tests: snapshot events of the contract's
three topics (`payload`), inserted in order (`insert`, `backlog`), and counted."""

from __future__ import annotations

import uuid
from collections import defaultdict
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from pin_pipelines.kafka import TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP, TOPIC_PROJECT

TOPICS = [TOPIC_PROJECT, TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP]


def payload(topic: str, key: str, version: int, **fields: Any) -> dict[str, Any]:
    """A snapshot event as the recalc writes it (jsonb_build_object of the contract fields)."""
    entity: dict[str, Any] = {
        TOPIC_PROJECT: {
            "TenantId": str(uuid.uuid4()), "Name": "ЖК Северный", "Status": "Published",
            "PriceMin": 5250000.5, "PriceMax": None, "PropertyObjectsTotalCount": 12,
            "PropertyObjectsFreeCount": 3,
        },
        TOPIC_LAYOUT: {
            "ProjectId": str(uuid.uuid4()), "LayoutGroupId": None, "Name": "2К-54",
            "TotalArea": 54.3, "PropertyObjectsCount": 7,
        },
        TOPIC_LAYOUT_GROUP: {
            "ProjectId": str(uuid.uuid4()), "TenantId": str(uuid.uuid4()), "Name": "Студии",
            "SortOrder": 2, "IsArchived": False, "LayoutsCount": 4, "AreaMin": 21.5,
            "AreaMax": None,
        },
    }[topic]  # fmt: skip
    envelope: dict[str, Any] = {
        "ContractVersion": 1,
        "EventId": str(uuid.uuid4()),
        "CreatedAt": "2025-01-31T10:20:30.123Z",
        "Id": key,
        "Version": version,
    }
    return envelope | entity | fields


def insert(conn: psycopg.Connection, rows: list[tuple[str, str, Any]]) -> list[int]:
    """(topic, message_key, payload) rows in this order; returns their outbox ids."""
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO chessboard.outbox_events (topic, message_key, payload)"
            " VALUES (%s, %s, %s) RETURNING id",
            [(t, k, Jsonb(p)) for t, k, p in rows],
            returning=True,
        )
        ids = []
        while True:
            ids.append(cur.fetchone()[0])  # type: ignore[index]
            if not cur.nextset():
                return ids


def outbox_count(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT count(*) FROM chessboard.outbox_events").fetchone()[0]  # type: ignore[index]


def backlog(conn: psycopg.Connection, keys: int, versions: int) -> dict[str, list[str]]:
    """`keys` entities spread over the three topics, versions 1..`versions` each, inserted
    version-major (consecutive ids belong to different keys, as in a busy drain). Returns the
    EventIds per key."""
    entities = [(TOPICS[i % len(TOPICS)], str(uuid.uuid4())) for i in range(keys)]
    rows = [
        (topic, key, payload(topic, key, version))
        for version in range(1, versions + 1)
        for topic, key in entities
    ]
    insert(conn, rows)
    events: dict[str, list[str]] = defaultdict(list)
    for _, key, body in rows:
        events[key].append(body["EventId"])
    return events
