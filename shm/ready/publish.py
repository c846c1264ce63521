"""The ready set's writer, the keeper: publishing a set, fresh or ahead
(the protocol: shm/ready/layout.py)."""

from __future__ import annotations

import os
import struct
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate
from typing import Any, cast

from shm.ready.base import ReadySetBase
from shm.ready.layout import (
    ACTIVE_OFFSET,
    CHUNK,
    ENTRY_FORMAT,
    ENTRY_SIZE,
    FIRST_SLOT,
    FLAG_ASCII,
    GENERATION_OFFSET,
    LOW_WATER_OFFSET,
    RECORD,
    SLOT,
    SLOT_HEADER_SIZE,
    record_tag,
)
from shm.segment import U32

_STRUCTS = {1 << i: struct.Struct("<" + ENTRY_FORMAT * (1 << i)) for i in range(CHUNK.bit_length())}


def _pack_entries(mm, at: int, flat: list, n: int) -> None:
    """Pack ``n`` entries whose fields lie flattened in ``flat`` at ``mm[at]``."""
    if n == CHUNK:
        _STRUCTS[CHUNK].pack_into(mm, at, *flat)
        return
    done = 0
    for size in sorted(_STRUCTS, reverse=True):
        if n & size:
            _STRUCTS[size].pack_into(
                mm, at + ENTRY_SIZE * done, *flat[6 * done : 6 * (done + size)]
            )
            done += size


def _gather(
    keys: list[str | None], versions: Any, slots: Any, dues: Any, cids: Any, ranks: Any, n: int
) -> tuple[list[Any], list[int], list[int], list[int], list[float]]:
    """The five columns ``write_gathered`` would write, as lists."""
    at = memoryview(slots).cast("B").cast("i")[:n].tolist()
    return (
        [keys[i] for i in at],
        [versions[i] for i in at],
        memoryview(dues).cast("B").cast("i")[:n].tolist(),
        memoryview(cids).cast("B").cast("i")[:n].tolist(),
        cast(list[float], memoryview(ranks).cast("B").cast("d")[:n].tolist()),
    )


class ReadyWriter(ReadySetBase):
    """The keeper's side of the ready set (its only writer of entries)."""

    def publish(
        self,
        entries: Sequence[tuple[str, int, int, int, float]],
        now: float,
        ahead: bool = False,
    ) -> int:
        """Publish ``(key, version, due_minute, class_id, rank)`` in rank order.

        Returns how many entries were written: at most ``capacity``, fewer when
        their keys overflow the heap. Readers see the whole set or the last
        one. A bad entry (a field out of range) raises ValueError and leaves
        the last set published.

        ``ahead``: the next set, for claimers to switch to once the active one
        is drained (at once if it is drained already); the caller leaves the
        active set's keys out of it. Otherwise claimers take from this set
        from now on.
        """
        n = min(len(entries), self.capacity)

        def chunks():
            for start in range(0, n, CHUNK):
                yield zip(*entries[start : min(start + CHUNK, n)], strict=True)

        return self._publish(chunks(), now, ahead)

    def publish_columns(
        self,
        keys: Sequence[str],
        versions: Sequence[int],
        due_minutes: Sequence[int],
        class_ids: Sequence[int],
        ranks: Sequence[float],
        now: float,
        ahead: bool = False,
    ) -> int:
        """``publish`` for a caller that already holds columns: it skips
        transposing the tuples, about a quarter of the cost of a publish.
        Lists are written by one call into C (``_atomic.View.write_entries``,
        a fifth of the time of the chunked Python packing)."""
        cols = (keys, versions, due_minutes, class_ids, ranks)
        if len({len(col) for col in cols}) != 1:
            raise ValueError(f"columns differ in length: {[len(col) for col in cols]}")
        n = min(len(keys), self.capacity)
        if all(type(col) is list for col in cols):
            return self._publish(cols, now, ahead)

        def chunks():
            for start in range(0, n, CHUNK):
                end = min(start + CHUNK, n)
                yield (col[start:end] for col in cols)

        return self._publish(chunks(), now, ahead)

    def publish_gathered(
        self,
        keys: list[str | None],
        versions: Any,
        slots: Any,
        due_minutes: Any,
        class_ids: Any,
        ranks: Any,
        n: int,
        now: float,
        ahead: bool = False,
    ) -> int:
        """``publish_columns`` for a writer that keeps its rows in columns by
        slot (the keeper's buckets): entry i is ``(keys[slots[i]],
        versions[slots[i]], due_minutes[i], class_ids[i], ranks[i])`` for i
        below ``n``. ``keys`` is a list of str by slot, or the keeper's
        ``KeyColumn`` (keeper/_keys.c), whose UTF-8 the writer copies where it
        lies; ``versions`` a buffer of int64 by slot (``array('q')``);
        ``slots``, ``due_minutes`` and ``class_ids`` buffers of int32,
        ``ranks`` of double (``array('i')``, ``array('d')``, or the bytes
        ``keeper._best.pick`` gives). Written by one call into C
        (``_atomic.View.write_gathered``) that makes no Python object an
        entry. Returns how many were written, the first of ``slots`` (fewer
        than ``n`` when the heap filled; the keeper makes their keys after
        the publication, ``Gathered.keys_written``), and the slot holds the
        same bytes as ``publish_columns`` of the gathered columns."""
        n = min(n, self.capacity)

        def fill(view: Any, mm: Any, base: int) -> tuple[int, int, int]:
            entries_at, heap_at = base + SLOT_HEADER_SIZE, base + self._heap_at
            write = getattr(view, "write_gathered", None)
            if write is not None:
                count, used, ascii = write(
                    entries_at, heap_at, self.heap_size, n,
                    keys, versions, slots, due_minutes, class_ids, ranks,
                )  # fmt: skip
            else:  # an older build of shm._atomic: gather, then write_entries
                cols = _gather(keys, versions, slots, due_minutes, class_ids, ranks, n)
                count, used, ascii = view.write_entries(
                    entries_at, heap_at, self.heap_size, n, *cols
                )
            return count, used, FLAG_ASCII if ascii else 0

        return self._publish(fill, now, ahead)

    def _publish(self, chunks: Any, now: float, ahead: bool) -> int:
        """Write a set into the slot not active: ``chunks`` are an iterable of
        column chunks (``_write_chunks``), a tuple of five whole columns as
        lists (``write_entries``), or a function of ``(view, mm, slot base)``
        that writes the entries and keys and returns ``(count, heap used,
        flags)``."""
        mm = self.segment.mm
        view = self._view if self._view is not None else self._atomics()
        pid = os.getpid()
        if self._stamped_pid != pid:
            self.segment.set_writer_pid(pid)
            self._stamped_pid = pid
        # Claimers switch only to a pending set, and this handle is the only
        # writer: the slot not active now is the one no claimer takes from.
        active = view.load64(ACTIVE_OFFSET) & 1
        slot = 1 - active
        base = self._slot_base(slot)
        generation = SLOT.unpack_from(mm, self._slot_base(active))[2] + 1
        seq = U32.unpack_from(mm, base)[0]
        # Odd while writing; a keeper that died mid-write left it odd already.
        # Entries are encoded straight into this slot: should one fail, the
        # slot stays odd and is never flipped to.
        seq = (seq + 1 if seq % 2 == 0 else seq + 2) & 0xFFFFFFFF
        view.begin32(base, seq)  # then a release fence: no write below is seen before it
        # No grant record survives from an older set (a late one a lapped
        # claimer writes from now on names an older tag, and is ignored).
        at = base + self._records_at
        mm[at : at + len(self._no_records)] = self._no_records
        if callable(chunks):
            count, heap_used, flags = chunks(view, mm, base)
        elif isinstance(chunks, tuple):  # whole columns, as lists: written in C
            n = min(len(chunks[0]), self.capacity)
            at = base + SLOT_HEADER_SIZE
            count, heap_used, ascii = view.write_entries(
                at, base + self._heap_at, self.heap_size, n, *chunks
            )
            flags = FLAG_ASCII if ascii else 0
        else:
            count, heap_used, flags = self._write_chunks(mm, base, chunks)
        # The cursor starts over at 0, tagged with the seq this publish ends on.
        done = (seq + 1) & 0xFFFFFFFF
        SLOT.pack_into(mm, base, seq, count, generation, now, done << 32, heap_used, flags)
        # Release: a claimer that reads this seq with acquire sees every
        # entry, key and header field written above.
        view.release32(base, done)
        # A new set answers any pending request for one. Cleared before the
        # switch: a claimer still on the old set may set it again, which costs
        # one spare publish, never a lost request about the new set.
        view.store64(LOW_WATER_OFFSET, 0)
        self._slot_publish[slot] = (count, record_tag(done))
        self.last_slot = slot
        if not ahead:
            view.store64(ACTIVE_OFFSET, slot | (generation & 0xFFFFFFFF) << 32)
            self.segment.futex_wake(GENERATION_OFFSET)
        elif self._drained(mm, FIRST_SLOT + active * self._stride):
            # Claimers found the active set empty before this one was done:
            # they wait for it.
            self._switch(view, view.load64(ACTIVE_OFFSET))
        return count

    def grant_records(self, slot: int) -> tuple[memoryview, int, int] | None:
        """Writer: ``(records, count, tag)`` of this handle's last publish
        into ``slot`` (it stays as it is until the next publish there), for
        the keeper's lease scan; None before the first. ``records`` is a view
        of the slot's grant records, read as claimers write them."""
        last = self._slot_publish[slot]
        if last is None:
            return None
        count, tag = last
        if not self._records:
            with memoryview(self.segment.mm) as mv:
                for i in range(2):
                    at = self._slot_base(i) + self._records_at
                    self._records.append(mv[at : at + RECORD * self.capacity])
        return self._records[slot], count, tag

    def _write_chunks(self, mm, base: int, chunks) -> tuple[int, int, int]:
        """Encode and write every chunk; (entries written, heap bytes, flags)."""
        entries_at = base + SLOT_HEADER_SIZE
        heap_at = base + self._heap_at
        count = heap_used = 0
        flags = FLAG_ASCII
        for chunk in chunks:
            keys, versions, dues, classes, ranks = chunk
            text = "".join(keys)
            blob = text.encode()
            if len(blob) == len(text):
                lens = list(map(len, keys))
            else:
                flags = 0
                lens = [len(key.encode()) for key in keys]
            bounds = list(accumulate(lens, initial=heap_used))  # key i is bounds[i:i+2]
            n = len(lens)
            if bounds[n] > self.heap_size:
                # The heap is full: keep the keys that fit whole, and stop.
                n = bisect_right(bounds, self.heap_size) - 1
                classes, versions, dues, ranks = classes[:n], versions[:n], dues[:n], ranks[:n]
                lens = lens[:n]
                blob = blob[: bounds[n] - heap_used]
            end = bounds[n]
            del bounds[n:]  # what is left: the n keys' offsets
            flat = self._flat if n == CHUNK else [0] * (6 * n)
            try:
                flat[0::6] = bounds
                flat[1::6] = lens
                flat[2::6] = classes
                flat[3::6] = versions
                flat[4::6] = dues
                flat[5::6] = ranks
                _pack_entries(mm, entries_at + ENTRY_SIZE * count, flat, n)
            except struct.error as exc:
                raise ValueError(
                    f"ready entries {count}..{count + n - 1}: a field does not fit (key_len and "
                    f"class_id are u16, version u64, due_minute i64): {exc}"
                ) from exc
            mm[heap_at + heap_used : heap_at + end] = blob
            count += n
            heap_used = end
            if n < len(keys):
                break
        return count, heap_used, flags

    def take_low_water(self) -> bool:
        """Keeper: whether a claimer asked for a republish; clears the request."""
        return self._atomics().cas64(LOW_WATER_OFFSET, 1, 0) == 1
