"""Payloads checked against their topic's contract (pin_pipelines/contracts): what the relay
publishes (read back by `tests.support.relay.consume_messages`) and what the loader tests give
the loader as good events (`tests.support.devstats.produce_events`)."""

from __future__ import annotations

import json
import string
from functools import cache
from typing import Any

from hypothesis import strategies as st
from jsonschema import Draft7Validator, FormatChecker

from pin_pipelines.contracts import contract_topics, schema
from pin_pipelines.kafka import TOPIC_LAYOUT, TOPIC_LAYOUT_GROUP, TOPIC_PROJECT

#: The fields each topic's payload carries at least, as the outside contract lists them (section
#: 4, envelope included): what the schemas' `required` and the relay's output are held to.
ENVELOPE = ["ContractVersion", "EventId", "CreatedAt", "Id", "Version"]
CONTRACT_FIELDS = {
    TOPIC_PROJECT: [*ENVELOPE, "TenantId", "Name", "Status", "PriceMin", "PriceMax",
                    "PropertyObjectsTotalCount", "PropertyObjectsFreeCount"],
    TOPIC_LAYOUT: [*ENVELOPE, "ProjectId", "LayoutGroupId", "TotalArea", "PropertyObjectsCount"],
    TOPIC_LAYOUT_GROUP: [*ENVELOPE, "ProjectId", "TenantId", "Name", "SortOrder", "IsArchived",
                         "LayoutsCount", "AreaMin", "AreaMax"],
}  # fmt: skip


@cache
def validator(topic: str) -> Draft7Validator:
    return Draft7Validator(schema(topic), format_checker=FormatChecker())


def violations(topic: str, payload: dict[str, Any] | bytes | str) -> list[str]:
    """What `payload` breaks of `topic`'s contract, one line each (none: it keeps it)."""
    document = payload if isinstance(payload, dict) else json.loads(payload)
    return [
        f"{error.json_path}: {error.message}"
        for error in sorted(validator(topic).iter_errors(document), key=str)
    ]


def assert_in_contract(topic: str, payload: dict[str, Any] | bytes | str) -> None:
    """`payload` keeps `topic`'s contract; a topic without one (a test's own) is not checked."""
    if topic in contract_topics():
        found = violations(topic, payload)
        assert not found, f"a {topic} payload breaks its contract: {found}"


#: Extra fields a payload may carry (readers ignore them): names no contract property has.
EXTRA_NAMES = st.text(alphabet=string.ascii_letters, min_size=1, max_size=12).map("X".__add__)
EXTRA_VALUES = st.none() | st.booleans() | st.integers() | st.text(max_size=8)


def _json_type(name: str, rule: dict[str, Any]) -> st.SearchStrategy[Any]:
    if name == "null":
        return st.none()
    if name == "boolean":
        return st.booleans()
    if name == "integer":
        return st.integers(min_value=rule.get("minimum"), max_value=rule.get("maximum"))
    if name == "number":
        return st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(10**15), 10**15)
    if name == "string":
        pattern = rule.get("pattern")
        return st.from_regex(pattern, fullmatch=True) if pattern else st.text(max_size=40)
    raise NotImplementedError(f"a contract property of type {name!r}")


def values(rule: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values a contract property admits. Written here, not hypothesis-jsonschema's `from_schema`:
    0.23.1, its last release, fails on the Hypothesis this project locks (`'many' object has no
    attribute 'more'`); the contracts use a small subset of JSON Schema (const, enum, anyOf,
    type with bounds or a pattern), and an unknown keyword fails here rather than be ignored."""
    known = {"const", "enum", "anyOf", "type", "minimum", "maximum", "pattern", "format"}
    unknown = set(rule) - known - {"description", "title"}
    if unknown:
        raise NotImplementedError(f"contract keywords {sorted(unknown)}")
    if "const" in rule:
        return st.just(rule["const"])
    if "enum" in rule:
        return st.sampled_from(rule["enum"])
    if "anyOf" in rule:
        return st.one_of([values(option) for option in rule["anyOf"]])
    types = rule["type"] if isinstance(rule["type"], list) else [rule["type"]]
    return st.one_of([_json_type(name, rule) for name in types])


def payloads(topic: str) -> st.SearchStrategy[dict[str, Any]]:
    """Payloads that keep `topic`'s contract: every property it describes (the optional ones
    sometimes left out) and sometimes extra fields."""
    document = schema(topic)
    required = set(document["required"])
    properties = document["properties"]
    return st.fixed_dictionaries(
        {name: values(rule) for name, rule in properties.items() if name in required},
        optional={name: values(rule) for name, rule in properties.items() if name not in required},
    ).flatmap(
        lambda payload: st.dictionaries(
            EXTRA_NAMES.filter(lambda name: name not in properties), EXTRA_VALUES, max_size=3
        ).map(lambda extra: {**extra, **payload})
    )
