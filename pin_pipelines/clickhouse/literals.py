"""Query parameters rendered as ClickHouse literals on the client, the same way for both backends.

Server-side parameters (`{name:Type}`) are not available on every supported server (18.16 has none
on the native protocol), so `%(name)s` placeholders are filled here with escaped literals.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Set
from dataclasses import dataclass
from uuid import UUID


@dataclass(frozen=True)
class UuidSet:
    """Many UUIDs for `x IN %(name)s`, passed the cheapest way the backend has: a server's query
    gets them as a binary external table (ServerClickHouse.rows), anything else as one string
    split by the engine. Both beat a tuple of 1000 UUID literals, whose parsing costs more than
    the read. Only UUIDs: they go into SQL unquoted inside that string."""

    ids: Collection[UUID]

    def __post_init__(self) -> None:
        if not all(isinstance(i, UUID) for i in self.ids):
            raise TypeError("a UuidSet holds uuid.UUID values only")


#: Scalars a placeholder accepts; a list, tuple or set of them becomes a tuple literal for `IN`.
Scalar = str | int | float | bool | UUID | None
Param = Scalar | list[Scalar] | tuple[Scalar, ...] | Set[Scalar] | UuidSet

_ESCAPES = str.maketrans(
    {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\0": "\\0"}
)


def literal(value: Param) -> str:
    """One value as a ClickHouse literal."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, UUID):
        return f"'{value}'"  # hex digits and dashes only
    if isinstance(value, str):
        return "'" + value.translate(_ESCAPES) + "'"
    if isinstance(value, UuidSet):
        if not value.ids:
            raise ValueError("an empty UuidSet cannot be rendered (`IN ()` is not valid SQL)")
        ids = ",".join(map(str, value.ids))  # hex digits and dashes only
        return f"(SELECT toUUID(arrayJoin(splitByChar(',', '{ids}'))))"
    items = sorted(value, key=str) if isinstance(value, Set) else list(value)
    if not items:
        raise ValueError("an empty collection cannot be rendered (`IN ()` is not valid SQL)")
    return "(" + ", ".join(literal(item) for item in items) + ")"


def render(
    sql: str, params: Mapping[str, Param] | None = None, verbatim: Mapping[str, str] | None = None
) -> str:
    """`sql` with each `%(name)s` replaced by the literal of `params[name]`, or by
    `verbatim[name]` as it is (a backend's own rendering); write `%%` for `%`."""
    if not params and not verbatim:
        return sql
    return sql % (
        {name: literal(value) for name, value in (params or {}).items()} | dict(verbatim or {})
    )
