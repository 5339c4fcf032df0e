"""The read API's query parameters (CONTRACT section 7): parsed here, described here.

The parameters are read from the query string by this module, not by FastAPI's validation, so
that one function decides what is accepted and says why in one line (`BadRequest`), and the
OpenAPI document states exactly that (the `*_PARAMETER` objects, built from the same pattern):
`ids` is 1 to 1,000 canonical UUIDs (8-4-4-4-12 hex digits, any case) separated by commas,
nothing else; `projectId` one such UUID. A parameter given twice is refused rather than half
read, and so is any parameter a route does not take: nothing names a developer, and a client
that tries (`developerId=…`) is told so instead of being answered for the token's developer
as if it had been heard.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any
from uuid import UUID

#: More ids than this in one request: 400 (the contract's bound, and the read's measured size).
MAX_IDS = 1000
#: A query string longer than this is refused before anything reads it: 1,000 ids with their
#: commas URL-encoded and a projectId take 40 KB.
MAX_QUERY_BYTES = 48 * 1024

_UUID = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
UUID_PATTERN = f"^{_UUID}$"
IDS_PATTERN = f"^{_UUID}(,{_UUID}){{0,{MAX_IDS - 1}}}$"
_ONE_UUID = re.compile(_UUID)
_IDS = re.compile(f"{_UUID}(?:,{_UUID})*")


class BadRequest(Exception):
    """A parameter the API does not accept: answered 400 with this one-line message."""


def only_known(names: Iterable[str], known: Collection[str]) -> None:
    """Refuse a parameter the route does not take (the first one, named when it is short and
    printable)."""
    for name in names:
        if name not in known:
            shown = (
                f" {name!r}" if name.isascii() and name.isprintable() and len(name) <= 40 else ""
            )
            raise BadRequest(
                f"unknown query parameter{shown}: this request takes {', '.join(sorted(known))}"
            )


def ids_parameter(raw: Sequence[str]) -> list[UUID]:
    """`ids` (every value the query string gave it) as UUIDs, in order, duplicates kept."""
    value = _single("ids", raw)
    if value is None or value == "":
        raise BadRequest("ids is required: 1 to 1,000 layout-group UUIDs separated by commas")
    parts = value.split(",")
    if len(parts) > MAX_IDS:
        raise BadRequest(f"ids holds {len(parts):,} ids: at most {MAX_IDS:,} per request")
    if not _IDS.fullmatch(value):  # one match for the whole list; the entry only for the message
        position = next(n for n, part in enumerate(parts, 1) if not _ONE_UUID.fullmatch(part))
        raise BadRequest(f"ids: entry {position} is not a UUID (8-4-4-4-12 hex digits)")
    return [UUID(part) for part in parts]


def project_parameter(raw: Sequence[str], *, required: bool) -> UUID | None:
    """`projectId` as a UUID; None when it is absent and not required."""
    value = _single("projectId", raw)
    if value is None:
        if required:
            raise BadRequest("projectId is required: the UUID of a project")
        return None
    if not _ONE_UUID.fullmatch(value):
        raise BadRequest("projectId is not a UUID (8-4-4-4-12 hex digits)")
    return UUID(value)


def _single(name: str, raw: Sequence[str]) -> str | None:
    if len(raw) > 1:
        raise BadRequest(f"{name} is given {len(raw)} times: give it once")
    return raw[0] if raw else None


def _parameter(name: str, description: str, schema: Mapping[str, Any], required: bool) -> Any:
    return {
        "name": name,
        "in": "query",
        "required": required,
        "description": description,
        "schema": dict(schema),
    }


IDS_PARAMETER = _parameter(
    "ids",
    "1 to 1,000 layout-group UUIDs separated by commas.",
    {"type": "string", "pattern": IDS_PATTERN, "maxLength": MAX_IDS * 37 - 1},
    required=True,
)


def project_id_parameter(*, required: bool) -> Any:
    """The `projectId` parameter's OpenAPI object (required on the groups' list)."""
    return _parameter(
        "projectId",
        "A project's UUID: only groups whose current row is in this project."
        if not required
        else "The project's UUID.",
        {"type": "string", "format": "uuid", "pattern": UUID_PATTERN},
        required=required,
    )
