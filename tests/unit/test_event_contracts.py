"""The event contracts as files (pin_pipelines/contracts): well-formed schemas, one per snapshot
topic; the loader and the contract agree on the layout-group event; the additive-change rule
(tests/support/contract_changes.py) tells additive changes from breaking ones."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft7Validator

from pin_pipelines.contracts import contract_topics, required_fields, schema
from pin_pipelines.devstats.events import BadEvent, parse_message
from pin_pipelines.kafka import TOPIC_LAYOUT_GROUP
from tests.support.contract_changes import breaking_changes, check
from tests.support.contracts import CONTRACT_FIELDS, payloads, violations


def test_every_snapshot_topic_has_one_well_formed_contract() -> None:
    """Tried: the schema of each topic against the JSON Schema meta-schema (draft 7), its $id,
    its required fields (the contract's list, each a property) and unknown fields allowed."""
    assert contract_topics() == sorted(CONTRACT_FIELDS)
    for topic in contract_topics():
        document = schema(topic)
        Draft7Validator.check_schema(document)
        assert document["$id"].endswith(f"/{topic}.schema.json")
        assert required_fields(topic) == CONTRACT_FIELDS[topic]
        assert set(required_fields(topic)) <= set(document["properties"])
        assert document["additionalProperties"] is True
        # A breaking change is a new ContractVersion and a new topic (`.v2`): they go together.
        assert document["properties"]["ContractVersion"]["const"] == int(topic.rsplit(".v", 1)[1])


def _created_at(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


#: Layout-group events as the contract allows them; CreatedAt from real instants (the schema's
#: pattern admits a 30 February, which its `format: date-time` refuses; the generator follows
#: the pattern only).
CONTRACT_EVENTS = st.builds(
    lambda event, created: {**event, "CreatedAt": created},
    payloads(TOPIC_LAYOUT_GROUP),
    st.datetimes(
        min_value=datetime(1970, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)
    ).map(_created_at),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(event=CONTRACT_EVENTS)
def test_the_loader_accepts_every_event_the_contract_allows(event: dict[str, Any]) -> None:
    """Tried: 100 generated layout-group payloads that keep the contract (any extra fields, any
    UUIDs, names, bounds, versions and sort orders it admits), keyed by their Id. The loader
    reads each one, field for field: nothing the contract allows goes to its dead letters."""
    assert violations(TOPIC_LAYOUT_GROUP, event) == []
    read = parse_message(event["Id"].encode(), json.dumps(event).encode())
    assert (str(read.id), read.version, str(read.project_id), str(read.tenant_id)) == (
        event["Id"], event["Version"], event["ProjectId"], event["TenantId"],
    )  # fmt: skip
    assert (read.name, read.sort_order, read.is_archived) == (
        event["Name"], event["SortOrder"], event["IsArchived"],
    )  # fmt: skip


#: Values of another JSON type than each field the loader reads.
WRONG_VALUES: list[Any] = [None, "7", 7, 7.5, True, [], {}]
LOADER_FIELDS = ["ContractVersion", "Id", "Version", "ProjectId", "TenantId", "Name",
                 "SortOrder", "IsArchived", "CreatedAt"]  # fmt: skip


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    event=CONTRACT_EVENTS,
    field=st.sampled_from(LOADER_FIELDS),
    value=st.sampled_from(WRONG_VALUES),
    drop=st.booleans(),
)
def test_an_event_outside_the_contract_on_a_field_the_loader_reads_is_refused_by_both(
    event: dict[str, Any], field: str, value: Any, drop: bool
) -> None:
    """Tried: a contract event with one field the loader reads removed, or set to a value of
    another JSON type. Whenever the contract refuses it, the loader does too (a dead letter,
    never a row)."""
    bad = copy.deepcopy(event)
    if drop:
        del bad[field]
    else:
        bad[field] = value
    if violations(TOPIC_LAYOUT_GROUP, bad):
        with pytest.raises(BadEvent):
            parse_message(event["Id"].encode(), json.dumps(bad).encode())


def _with(document: dict[str, Any], change: Any) -> dict[str, Any]:
    changed = copy.deepcopy(document)
    change(changed)
    return changed


def test_additive_changes_pass_and_breaking_ones_are_named() -> None:
    """Tried, on the layout-group contract: a new optional property and a new description
    (additive: nothing reported); a property removed, its type narrowed or widened, a required
    field made optional, unknown fields refused (each reported); and the same breaking change
    with a new ContractVersion (passes: a new contract)."""
    base = schema(TOPIC_LAYOUT_GROUP)
    props = "properties"
    additive = [
        _with(base, lambda d: d[props].update(Floor={"type": "integer"})),
        _with(base, lambda d: d[props]["Name"].update(description="The group's name.")),
    ]
    for new in additive:
        assert breaking_changes(base, new) == []
    breaking = {
        "removed": _with(base, lambda d: d[props].pop("SortOrder")),
        "narrowed": _with(base, lambda d: d[props]["AreaMin"].update(type="number")),
        "widened": _with(base, lambda d: d[props]["LayoutsCount"].update(type="number")),
        "optional": _with(base, lambda d: d["required"].remove("Name")),
        "closed": _with(base, lambda d: d.update(additionalProperties=False)),
    }
    found = {name: breaking_changes(base, new) for name, new in breaking.items()}
    assert found == {
        "removed": ["SortOrder: removed"],
        "narrowed": ['AreaMin: {"type": ["number", "null"]} → {"type": "number"}'],
        "widened": [
            'LayoutsCount: {"type": "integer", "minimum": 0, "maximum": 2147483647}'
            ' → {"type": "number", "minimum": 0, "maximum": 2147483647}'
        ],
        "optional": ["Name: no longer required"],
        "closed": ["unknown fields no longer allowed (additionalProperties: false)"],
    }
    new_version = _with(breaking["removed"], lambda d: d[props]["ContractVersion"].update(const=2))
    assert breaking_changes(base, new_version) == []


def test_the_contracts_history_in_this_repository_is_additive() -> None:
    """Every committed version of each contract (and the working tree's) against the one
    before it: what bin/test's lint runs."""
    assert check() == []
