"""The shape of a drift finding, shared by both checks, the CLI summary and the Dagster metadata."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from uuid import UUID

#: Rows kept for the "worst drifted rows" table: enough to act on, small enough for the UI.
WORST_ROWS = 50


@dataclass(frozen=True)
class DriftRow:
    """One drifted column of one row: what is stored and what the source of truth says."""

    entity: str
    id: UUID
    project_id: UUID | None
    column: str
    stored: Any
    expected: Any

    @property
    def magnitude(self) -> Decimal:
        """How far off a number is (a missing bound counts as its whole value); 0 for text."""
        if isinstance(self.stored, int | Decimal) or isinstance(self.expected, int | Decimal):
            stored = self.stored if isinstance(self.stored, int | Decimal) else 0
            expected = self.expected if isinstance(self.expected, int | Decimal) else 0
            return abs(Decimal(stored) - Decimal(expected))
        return Decimal(0)

    def as_dict(self) -> dict[str, str | None]:
        """Text values: JSON and Dagster table records carry them without type surprises."""
        return {
            "entity": self.entity,
            "id": str(self.id),
            "project_id": None if self.project_id is None else str(self.project_id),
            "column": self.column,
            "stored": _text(self.stored),
            "expected": _text(self.expected),
        }


def worst(rows: list[DriftRow], limit: int = WORST_ROWS) -> list[DriftRow]:
    """The rows an operator looks at first: largest difference, then a stable order."""
    return sorted(rows, key=lambda r: (-r.magnitude, r.entity, str(r.id), r.column))[:limit]


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, Decimal):
        return format(value.normalize(), "f") if value == value.to_integral() else str(value)
    return str(value)
