"""The layout-group event contract as the loader reads it: what is accepted, and the one-line
reason for each thing that is not (it becomes the DLQ's `error` header)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from pin_pipelines.devstats.events import BadEvent, newest_per_group, parse_event, parse_message

#: Fixed, not random: the parameters below name tests, and xdist needs every worker to collect
#: the same names.
ID = "5f0c6a8e-3b1d-4c2a-9e47-1d2b3c4d5e6f"
OTHER_ID = "0b9d8f7e-6a5c-4b3d-8e2f-1a0b9c8d7e6f"


def event(**changes: Any) -> dict[str, Any]:
    return {
        "ContractVersion": 1,
        "EventId": str(uuid.uuid4()),
        "CreatedAt": "2026-11-30T10:20:30.123Z",
        "Id": str(uuid.uuid4()),
        "Version": 3,
        "ProjectId": str(uuid.uuid4()),
        "TenantId": str(uuid.uuid4()),
        "Name": "Студии",
        "SortOrder": 7,
        "IsArchived": False,
        "LayoutsCount": 4,
        "AreaMin": 21.5,
        "AreaMax": None,
    } | changes


def test_a_valid_event_maps_to_the_dimension_row() -> None:
    raw = event(IsArchived=True, Unknown="ignored: additive minor change")
    parsed = parse_event(json.dumps(raw).encode())
    assert parsed.row() == (
        uuid.UUID(raw["Id"]),
        uuid.UUID(raw["ProjectId"]),
        uuid.UUID(raw["TenantId"]),  # DeveloperId = TenantId
        "Студии",
        7,
        1,
        3,  # SourceVersion = Version
        datetime(2026, 11, 30, 10, 20, 30, 123000, tzinfo=UTC),  # UpsertedAt = CreatedAt
    )


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"", "empty value"),
        (b"{not json", "not JSON"),
        (b"[1, 2]", "Expected `object`, got `array`"),
        (json.dumps(event(Version="5")).encode(), "Expected `int`, got `str` - at `$.Version`"),
        (json.dumps(event(Version=-1)).encode(), "Expected `int` >= 0 - at `$.Version`"),
        (json.dumps(event(Version=2**63)).encode(), "at `$.Version`"),
        (json.dumps(event(IsArchived="yes")).encode(), "Expected `bool`, got `str`"),
        (json.dumps(event(SortOrder=2**31)).encode(), "at `$.SortOrder`"),
        (json.dumps(event(Id="not-a-uuid")).encode(), "Invalid UUID - at `$.Id`"),
        (json.dumps(event(TenantId=None)).encode(), "got `null` - at `$.TenantId`"),
        (json.dumps(event(CreatedAt="2026-11-30T10:20:30")).encode(), "at `$.CreatedAt`"),
        (json.dumps(event(ContractVersion=2)).encode(), "Invalid enum value 2"),
    ],
)
def test_each_bad_value_is_refused_with_its_reason(value: bytes, reason: str) -> None:
    with pytest.raises(BadEvent) as refused:
        parse_event(value)
    message = str(refused.value)
    assert reason in message and "\n" not in message


def test_duplicates_in_a_batch_reduce_to_the_highest_version_first_on_a_tie() -> None:
    gid = str(uuid.uuid4())
    versions = [(2, "a"), (5, "b"), (3, "c"), (5, "d")]
    events = [
        parse_event(json.dumps(event(Id=gid, Version=v, Name=n)).encode()) for v, n in versions
    ]
    [newest] = newest_per_group(events).values()
    assert (newest.version, newest.name) == (5, "b")


def test_a_message_keyed_by_its_id_as_a_lowercase_uuid_is_read() -> None:
    raw = event(Id=str(uuid.uuid4()).upper())  # the value may spell it any way msgspec reads
    parsed = parse_message(raw["Id"].lower().encode(), json.dumps(raw).encode())
    assert parsed.id == uuid.UUID(raw["Id"])


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        (None, "no key is not the event's Id"),
        (b"", "key '' is not the event's Id"),
        (ID.upper().encode(), f"key '{ID.upper()}' is not the event's Id '{ID}' (lowercase UUID)"),
        (ID.replace("-", "").encode(), f"key '{ID.replace('-', '')}' is not"),
        (f"{{{ID}}}".encode(), f"key '{{{ID}}}' is not"),
        (f"{ID} ".encode(), f"key '{ID} ' is not"),
        (OTHER_ID.encode(), f"is not the event's Id '{ID}'"),
        (b"\xff" * 200, "key '" + "\ufffd" * 80 + "' is not"),
    ],
)
def test_a_message_keyed_otherwise_is_refused_with_its_reason(
    key: bytes | None, reason: str
) -> None:
    with pytest.raises(BadEvent) as refused:
        parse_message(key, json.dumps(event(Id=ID)).encode())
    message = str(refused.value)
    assert reason in message and "\n" not in message


def test_a_bad_value_is_reported_before_a_bad_key() -> None:
    with pytest.raises(BadEvent, match=r"^not JSON"):
        parse_message(None, b"{not json")
