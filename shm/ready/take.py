"""The ready set's readers: claimers taking entries, snapshots, waiting for a
publish (the protocol: shm/ready/layout.py)."""

from __future__ import annotations

import os
import time
from itertools import repeat
from typing import Any

from node.core.errors import NotGranting
from shm.ready.base import ReadySetBase, _atomic
from shm.ready.layout import (
    ACTIVE_OFFSET,
    CLAIM_CURSOR,
    CURSOR_INDEX,
    ENTRY,
    ENTRY_SIZE,
    FIRST_SLOT,
    FLAG_ASCII,
    GENERATION_OFFSET,
    GRANT_UNTIL_OFFSET,
    LOW_WATER,
    LOW_WATER_OFFSET,
    READ_RETRIES,
    SLOT,
    SLOT_GENERATION,
    SLOT_HEADER_SIZE,
    ReadyEntry,
    ReadySnapshot,
)
from shm.segment import U32, SnapshotUnstable


def not_granting(until_ns: int, now_ns: int) -> NotGranting:
    """A take's refusal at ``now_ns`` (CLOCK_MONOTONIC) past the grant deadline."""
    return NotGranting(
        f"the grant deadline passed {max(0, now_ns - until_ns) / 1e9:.3f} s ago: this node "
        "has not renewed its fleet membership, so another node may own its rows; retry "
        "once it has (docs/fleet.md)"
    )


class ReadyReader(ReadySetBase):
    """The claimers' side of the ready set (and the console's snapshots)."""

    @property
    def generation(self) -> int:
        """The newest published generation (0 before the first publish)."""
        mm = self.segment.mm
        active = _atomic.acquire64(mm, ACTIVE_OFFSET) & 1
        return _atomic.acquire64(mm, self._slot_base(active) + SLOT_GENERATION)

    def take(self, n: int) -> tuple[int, list[ReadyEntry]]:
        """Take the next ``n`` entries of the active set, in rank order:
        ``(generation, entries)``, fewer than ``n`` when the set runs out.
        A take that finds the active set drained switches to the next set if
        it is pending (``_switch``) and takes from that; none when nothing is
        pending (wait for the next publish with ``wait_publish(generation,
        ...)``).

        No two takes of one set get the same entry, in any process (a
        fetch-add on the slot's claim cursor). Raises SnapshotUnstable if the
        keeper laps this reader ``READ_RETRIES`` times in a row, and
        NotGranting, taking nothing, once the grant deadline has passed.
        """
        if n <= 0:
            return self.generation, []
        view = self._view if self._view is not None else self._atomics()
        until = view.load64(GRANT_UNTIL_OFFSET)
        if until:  # a fleet's node: the clock is read only then
            now_ns = time.monotonic_ns()
            if now_ns >= until:
                raise not_granting(until, now_ns)
        mm = self.segment.mm
        for _ in range(READ_RETRIES):
            word = view.load64(ACTIVE_OFFSET)
            base = FIRST_SLOT + (word & 1) * self._stride
            seq = view.load32(base)  # the header and entries are read after it
            _seq, count, generation, _at, cursor, _used, flags = SLOT.unpack_from(mm, base)
            count = min(count, self.capacity)
            if seq & 1 or cursor >> 32 != seq:
                pass  # mid-publish, or a header torn by one
            elif cursor & CURSOR_INDEX >= count:
                # Drained: no add, so claimers polling an empty set neither
                # bounce the cursor's cache line nor push the index on.
                if view.check32(base, seq):
                    if self._switch(view, word):
                        continue  # the next set is active now: take from it
                    self.last_count, self.last_left = count, 0
                    return generation, []
            else:
                old = view.add64(base + CLAIM_CURSOR, n)
                if old >> 32 != seq:
                    # The slot was republished between the read and the add:
                    # the entries taken are the new set's (its tag says so).
                    header = self._settled(view, mm, base, old >> 32)
                    if header is None:
                        continue  # lapped twice: those entries wait for the next set
                    seq, count, generation, flags = header
                start = old & CURSOR_INDEX
                end = min(start + n, count)
                entries = self._copy_entries(mm, base, start, end, flags) if start < end else []
                if view.check32(base, seq) and entries is not None:
                    self.last_count, self.last_left = count, max(0, count - start - n)
                    return generation, entries
            self.retries += 1
            os.sched_yield()
        raise SnapshotUnstable(
            f"{self.segment.name}: no consistent take in {READ_RETRIES} tries; "
            f"the keeper (pid {self.segment.writer_pid}) rewrites faster than it can be read"
        )

    def _settled(self, view: Any, mm: Any, base: int, tag: int) -> tuple[int, int, int, int] | None:
        """(seq, count, generation, flags) of the slot once its publish tagged
        ``tag`` has finished (it is one store away when a claimer's add finds
        its cursor); None if the slot has moved past that publish. The caller
        checks the seq again (``check32``) after it copied the entries."""
        for _ in range(READ_RETRIES):
            seq = view.load32(base)
            _seq, count, generation, _at, _cursor, _used, flags = SLOT.unpack_from(mm, base)
            if seq == tag:
                return seq, min(count, self.capacity), generation, flags
            if seq != (tag - 1) & 0xFFFFFFFF:
                return None
            os.sched_yield()
        return None

    def _copy_entries(
        self, mm: Any, base: int, start: int, end: int, flags: int
    ) -> list[ReadyEntry] | None:
        """Entries ``start:end`` of the slot at ``base``; None when what was
        read cannot be a published set (a torn copy: the caller retries)."""
        at = base + SLOT_HEADER_SIZE + ENTRY_SIZE * start
        fields = list(ENTRY.iter_unpack(mm[at : at + ENTRY_SIZE * (end - start)]))
        lo = fields[0][0]
        hi = fields[-1][0] + fields[-1][1]
        if not 0 <= lo <= hi <= self.heap_size:
            return None
        heap_at = base + self._heap_at
        heap = mm[heap_at + lo : heap_at + hi]
        try:
            if flags & FLAG_ASCII:
                text = heap.decode("ascii")
                return [
                    ReadyEntry(text[o - lo : o - lo + k], version, due, cid, rank)
                    for o, k, cid, version, due, rank in fields
                ]
            return [
                ReadyEntry(heap[o - lo : o - lo + k].decode(), version, due, cid, rank)
                for o, k, cid, version, due, rank in fields
            ]
        except UnicodeDecodeError:
            return None

    def remaining(self) -> int:
        """Entries not yet taken: the active set's, and the pending set's if
        there is one (a racy count: a hint)."""
        mm = self.segment.mm
        base = self._slot_base(U32.unpack_from(mm, ACTIVE_OFFSET)[0] & 1)
        _seq, count, _gen, _at, cursor, _used, _flags = SLOT.unpack_from(mm, base)
        count = min(count, self.capacity)
        left = count - min(cursor & CURSOR_INDEX, count)
        if self.pending():
            other = self._slot_base(1 - (U32.unpack_from(mm, ACTIVE_OFFSET)[0] & 1))
            _seq, count, _gen, _at, cursor, _used, _flags = SLOT.unpack_from(mm, other)
            count = min(count, self.capacity)
            left += count - min(cursor & CURSOR_INDEX, count)
        return left

    def request_publish(self) -> bool:
        """A claimer took from the active set: ask the keeper for the next one
        unless it is pending already. True when this call raised the flag
        (then post the keeper's wake semaphore); False when a request or the
        next set was pending already."""
        view = self._view if self._view is not None else self._atomics()
        return (
            view.load64(LOW_WATER_OFFSET) == 0
            and not self.pending()
            and view.cas64(LOW_WATER_OFFSET, 0, 1) == 0
        )

    @property
    def low_water(self) -> bool:
        """Whether a republish request is pending (for tests and the console)."""
        return LOW_WATER.unpack_from(self.segment.mm, LOW_WATER_OFFSET)[0] != 0

    def wait_publish(self, after_generation: int, timeout_s: float | None) -> int:
        """Block until the generation differs from ``after_generation``; return it.

        Returns ``after_generation`` unchanged when ``timeout_s`` passes first.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        mm = self.segment.mm
        while True:
            # Read the futex word before the generation: a publish between the
            # two makes the wait return at once instead of being missed.
            word = _atomic.acquire32(mm, GENERATION_OFFSET)
            current = self.generation
            if current != after_generation:
                return current
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return current
            self.segment.futex_wait(GENERATION_OFFSET, word, remaining)

    def snapshot(self, slot: int | None = None) -> ReadySnapshot:
        """A consistent copy of the active set, or of what ``slot`` holds
        (whether pending, retired or active). Raises SnapshotUnstable if the
        keeper laps this reader ``READ_RETRIES`` times in a row."""
        mm = self.segment.mm
        seq_copy = _atomic.seq_copy
        for _ in range(READ_RETRIES):
            active = _atomic.acquire32(mm, ACTIVE_OFFSET) if slot is None else slot
            base = self._slot_base(active & 1)
            # Three copies under the slot's seqlock, each fenced in C: they
            # belong to one publish when all three read the same even seq.
            header = seq_copy(mm, base, base, SLOT.size)
            if header is not None:
                seq, fields = header
                _seq, count, generation, published_at, _cursor, heap_used, flags = SLOT.unpack(
                    fields
                )
                # Bounds clamp what a torn header could claim.
                at = base + SLOT_HEADER_SIZE
                entries = seq_copy(mm, base, at, ENTRY_SIZE * min(count, self.capacity))
                at = base + self._heap_at
                keys = seq_copy(mm, base, at, min(heap_used, self.heap_size))
                if entries is not None and keys is not None and entries[0] == keys[0] == seq:
                    raw, heap = entries[1], keys[1]
                    break
            self.retries += 1
            os.sched_yield()
        else:
            raise SnapshotUnstable(
                f"{self.segment.name}: no consistent copy in {READ_RETRIES} tries; "
                f"the keeper (pid {self.segment.writer_pid}) rewrites faster than it can be read"
            )
        return ReadySnapshot(generation, published_at, _decode(raw, heap, count, flags))


def _decode(raw: bytes, heap: bytes, n: int, flags: int) -> list[ReadyEntry]:
    if n == 0:
        return []
    with memoryview(raw) as mv:
        with mv.cast("I") as u32, mv.cast("H") as u16:
            offsets = u32[0::8].tolist()
            lens = u16[2::16].tolist()
            classes = u16[3::16].tolist()
        with mv.cast("Q") as u64, mv.cast("q") as i64, mv.cast("d") as f64:
            versions = u64[1::4].tolist()
            dues = i64[2::4].tolist()
            ranks = f64[3::4].tolist()
    if flags & FLAG_ASCII:
        text = heap.decode("ascii")  # one decode, then slices
        keys = [text[o : o + k] for o, k in zip(offsets, lens, strict=True)]
    else:
        keys = [heap[o : o + k].decode() for o, k in zip(offsets, lens, strict=True)]
    return list(
        map(
            tuple.__new__,
            repeat(ReadyEntry),
            zip(keys, versions, dues, classes, ranks, strict=True),
        )
    )
