"""What a backfill inserts when it replays a LayoutGroupId range only (spec 003, "Backfill":
checkpoint "Kafka offset / диапазон LayoutGroupId"): `pin devstats backfill --from-id --to-id`
and dim_layout_group_backfill_job's `from_id`/`to_id`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final
from uuid import UUID

from pin_pipelines.errors import PinError


@dataclass(frozen=True)
class IdRange:
    """LayoutGroupIds from `first` to `last`, both included; a side left None is unbounded.

    UUIDs compare as 128-bit numbers, the order of their lowercase text, which an operator can
    check by eye (ClickHouse sorts its UUID type otherwise: the second half first). An empty
    range is refused: a backfill that can insert nothing is a typo, not a request.
    """

    first: UUID | None = None
    last: UUID | None = None

    def __post_init__(self) -> None:
        if self.first is not None and self.last is not None and self.first > self.last:
            raise PinError(
                f"from-id {self.first} is greater than to-id {self.last}: no LayoutGroupId is in "
                "that range"
            )

    @property
    def bounded(self) -> bool:
        return self.first is not None or self.last is not None

    def __contains__(self, group: UUID) -> bool:
        return (self.first is None or self.first <= group) and (
            self.last is None or group <= self.last
        )


EVERY_GROUP: Final = IdRange()


@dataclass(frozen=True)
class RangedReplay:
    """A backfill of `ids` over the offsets the loader's group had passed before it (`passed`:
    partition → first offset not passed). There an event of another group was applied already
    and is read without being inserted. Past it the events were never loaded: each is loaded
    whatever its group, as the regular load does, since the backfill moves the group past them
    and leaving them out would lose them."""

    ids: IdRange
    passed: Mapping[int, int]

    def skips(self, group: UUID, partition: int, offset: int) -> bool:
        return offset < self.passed.get(partition, 0) and group not in self.ids
