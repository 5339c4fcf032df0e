"""Where a loader stands in each partition assigned to it, as plain data: what a bounded cycle
still has to read, where each partition was finished, and the offsets that are committable
because every batch before them is stored. The cycle (loader.py) changes it as messages arrive
and batches are confirmed; nothing here talks to Kafka."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PartitionProgress:
    #: A continuous load reads on past every watermark; a bounded cycle up to those it had when
    #: its partitions were assigned.
    continuous: bool = False
    #: A bounded cycle's partitions with work left: partition → high watermark when assigned.
    pending: dict[int, int] = field(default_factory=dict)
    #: partition → next offset to read (a bounded cycle).
    nexts: dict[int, int] = field(default_factory=dict)
    #: partition → where it was finished: its end, transaction markers included.
    reached: dict[int, int] = field(default_factory=dict)
    #: partition → next offset, once every batch before it is stored: committable.
    applied: dict[int, int] = field(default_factory=dict)
    #: `applied` when last committed asynchronously.
    sent_commit: dict[int, int] = field(default_factory=dict)

    @property
    def more_coming(self) -> bool:
        """Whether anything is left to read: always for a continuous load."""
        return self.continuous or bool(self.pending)

    def expect(self, partition: int, start: int, high: int) -> bool:
        """An assigned partition's next offset is `start`, its high watermark `high`; False:
        nothing to read (a bounded cycle)."""
        if self.continuous:
            return True
        if start >= high:
            return False
        self.pending[partition], self.nexts[partition] = high, start
        return True

    def left(self) -> int:
        """Offsets a bounded cycle has left to read (markers counted: an overestimate); none
        counted for a continuous load."""
        return sum(self.pending[p] - self.nexts[p] for p in self.pending)

    def read(self, partition: int, offset: int, *, at_end: bool) -> tuple[bool, bool]:
        """A message at `offset` (or an end-of-partition event): whether to load it, and whether
        a bounded cycle is finished with the partition (read up to where it was expected to
        end). A partition not pending is past its start watermark: what arrives there is left
        for the next cycle."""
        if self.continuous:
            if at_end:  # committable once all before it is stored
                self.reached[partition] = offset
            return not at_end, False
        high = self.pending.get(partition)
        if high is None:
            return False, False
        load = not at_end and offset < high
        if load:
            self.nexts[partition] = offset + 1
        if not (at_end or offset + 1 >= high):
            return load, False
        # An end-of-partition event carries the end; a newer message, its own offset.
        self.reached[partition] = offset if at_end or offset >= high else offset + 1
        del self.pending[partition]
        return load, True

    def stored(self, ends: dict[int, int]) -> None:
        """A batch ending at `ends` is stored: its offsets are committable."""
        self.applied.update(ends)

    def skip_undelivered(self) -> None:
        """Every batch is stored: a finished partition's offset moves to where it was finished.

        A read_committed consumer is never handed a transaction's commit or abort marker nor an
        aborted transaction's events, yet they take offsets; committing only past the last loaded
        event would leave them as lag that every cycle reads again (a marker ends every
        transaction of the relay).
        """
        for p, end in self.reached.items():
            if end > self.applied.get(p, -1):
                self.applied[p] = end

    def unsent(self) -> dict[int, int]:
        """What is committable and not sent asynchronously yet (nothing after an idle poll),
        marked as sent."""
        if not self.applied or self.applied == self.sent_commit:
            return {}
        self.sent_commit = dict(self.applied)
        return self.sent_commit

    def forget(self) -> None:
        """The partitions are revoked or lost."""
        for state in (self.pending, self.nexts, self.reached, self.applied):
            state.clear()
