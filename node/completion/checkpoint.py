"""What the completion log knows of its segments, and its checkpoint.

``SegmentStats`` is one segment's accounting (results, live, acked,
discarded, the segments its retire records point at), which decides
compaction; ``Checkpoint`` is what compaction leaves of the segments it
removed (their lifetime counts, which ones, the floors of the next id and
segment number). ``BufferedLog`` (``buffered.py``) keeps both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# -- per-segment accounting and the checkpoint ----------------------------------------


@dataclass(slots=True)
class SegmentStats:
    """What the log knows about one segment on disk."""

    number: int
    first_id: int
    results: int = 0  # RESULT records read or written here
    live: int = 0  # of those, not retired (in memory)
    acked: int = 0  # of those, retired by a durable ACK record (wherever it lies)
    discarded: int = 0  # of those, retired by a durable DISCARD record
    # Earlier segments whose results this segment's retire records retire:
    # while one of them is on disk, this segment's records are still evidence.
    refs: set[int] = field(default_factory=set)
    damaged: bool = False  # recovery could not read all of it: kept for an operator
    # The latest retirement of any of its results (wall time; 0: none). One
    # time for the whole segment: what the lease evidence is kept by.
    retired_at: float = 0.0


@dataclass(slots=True)
class Checkpoint:
    """Lifetime counts of segments removed by compaction (their records are
    gone, so they cannot be recounted), which segments those were (so a
    crash between writing this and unlinking them cannot count them twice),
    and floors for the next id and segment number."""

    results: int = 0
    acked: int = 0
    discarded: int = 0
    removed: list[list[int]] = field(default_factory=list)  # [first, last] segment ranges
    next_id: int = 1
    next_segment: int = 1

    def covers(self, segment: int) -> bool:
        return any(lo <= segment <= hi for lo, hi in self.removed)

    def with_removed(
        self, stats: Sequence[SegmentStats], next_id: int, next_segment: int
    ) -> Checkpoint:
        ranges = sorted([list(r) for r in self.removed] + [[s.number, s.number] for s in stats])
        merged: list[list[int]] = []
        for lo, hi in ranges:
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return Checkpoint(
            results=self.results + sum(s.results for s in stats),
            acked=self.acked + sum(s.acked for s in stats),
            discarded=self.discarded + sum(s.discarded for s in stats),
            removed=merged,
            next_id=max(self.next_id, next_id),
            next_segment=max(self.next_segment, next_segment),
        )

    def to_dict(self) -> dict:
        return {
            "results": self.results,
            "acked": self.acked,
            "discarded": self.discarded,
            "removed": self.removed,
            "next_id": self.next_id,
            "next_segment": self.next_segment,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Checkpoint:
        return cls(
            results=int(d["results"]),
            acked=int(d["acked"]),
            discarded=int(d["discarded"]),
            removed=[[int(lo), int(hi)] for lo, hi in d["removed"]],
            next_id=int(d["next_id"]),
            next_segment=int(d["next_segment"]),
        )
