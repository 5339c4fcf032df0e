"""The layout-group-upserted.v1 payload (contract section 4) and its row in dim_layout_group."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_pascal

INT32 = (-(2**31), 2**31 - 1)
INT64_MAX = 2**63 - 1


class BadEvent(ValueError):
    """A message the loader cannot read; its text goes to the DLQ's `error` header."""


class LayoutGroupUpserted(BaseModel):
    """The fields dev-stats replicates. Strict: `"5"` is not a version and `"yes"` not a flag, so a
    producer bug lands in the DLQ instead of the dimension. Unknown fields are ignored (additive
    minor changes)."""

    model_config = ConfigDict(
        alias_generator=to_pascal,
        extra="ignore",
        strict=True,
        frozen=True,
    )

    contract_version: Literal[1]
    id: UUID
    version: int = Field(ge=0, le=INT64_MAX)
    project_id: UUID
    tenant_id: UUID
    name: str
    sort_order: int = Field(ge=INT32[0], le=INT32[1])
    is_archived: bool
    created_at: AwareDatetime

    def row(self) -> tuple[object, ...]:
        """The dimension row, in COLUMNS order: DeveloperId = TenantId, SourceVersion = Version,
        UpsertedAt = CreatedAt (the spec's mapping)."""
        return (
            self.id,
            self.project_id,
            self.tenant_id,
            self.name,
            self.sort_order,
            int(self.is_archived),
            self.version,
            self.created_at,
        )


COLUMNS = (
    "LayoutGroupId",
    "ProjectId",
    "DeveloperId",
    "Name",
    "SortOrder",
    "IsArchived",
    "SourceVersion",
    "UpsertedAt",
)


def parse_event(value: bytes | None) -> LayoutGroupUpserted:
    """The event in a message value, or BadEvent saying what is wrong (one line)."""
    if not value:
        raise BadEvent("empty value")
    try:
        return LayoutGroupUpserted.model_validate_json(value)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(part) for part in error['loc']) or 'value'}: {error['msg']}"
            for error in exc.errors(include_url=False)
        ]
        prefix = "not JSON" if exc.errors()[0]["type"] == "json_invalid" else "invalid event"
        raise BadEvent(f"{prefix}: {'; '.join(problems)}"[:1000]) from exc


def newest_per_group(events: Iterable[LayoutGroupUpserted]) -> dict[UUID, LayoutGroupUpserted]:
    """Duplicates within a batch reduced to the highest Version per group (first one on a tie)."""
    newest: dict[UUID, LayoutGroupUpserted] = {}
    for event in events:
        kept = newest.get(event.id)
        if kept is None or event.version > kept.version:
            newest[event.id] = event
    return newest
