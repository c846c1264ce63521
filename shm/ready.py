"""The ready set: the best K due keys, published by the keeper, read by claimers.

``/queue-node.<name>.ready``. The supervisor creates and unlinks it; the keeper
is its only writer of entries (publishing from two processes at once would
break the seqlocks); claimers and the console attach and close. Claimers write
two words only: a slot's ``claim_cursor`` and the header's ``low_water``, both
with atomic read-modify-writes (``shm._atomic``).

Double-buffered. The keeper writes the slot that is *not* active, under that
slot's seqlock. A reader takes ``active``, copies that slot's entries and keys
between two reads of the slot's seqlock, and retries if the counter was odd or
moved (the keeper lapped it twice). A keeper that dies, or a publish that
fails, mid-write leaves only the inactive slot odd and never switches to it:
the active set stays readable.

Two kinds of publish:

- A fresh set (``publish``): the keeper switches to it at once. Every second,
  and whenever the keeper's picture changed as a whole (load, pause).
- The next set, published ahead (``publish(..., ahead=True)``): while
  claimers drain the active set, the keeper writes the next K best keys (the
  active set's keys left out) into the other slot and does not switch. That
  slot is then *pending*: finished (seq even, cursor tagged) and one
  generation newer than the active one. The first claimer to find the active
  set drained switches to it (a compare-and-swap of the switch word), and so
  does the keeper should the set drain while it writes: the claimers never
  wait for a publish while the keeper keeps up.

A switch is one compare-and-swap of the *switch word*, the u64 at 24 that
holds ``active`` and the ``generation`` futex word together; whoever switched
wakes the futex's waiters.

Layout (little-endian, every field naturally aligned)::

    segment header
    offset  size  field         format
    0       24    common header (magic, layout, writer pid, owner pid, size;
                  see shm/segment.py)
    24      4     active        I    index of the slot claimers take from,
                                     0 or 1
    28      4     generation    I    futex word: low 32 bits of the active
                                     slot's generation; woken at every
                                     switch. With ``active``: the switch
                                     word, one u64, changed by a store (the
                                     keeper) or a compare-and-swap (a switch
                                     to a pending set)
    32      4     capacity      I    entries per slot (K)
    36      4     heap_size     I    key bytes per slot: K * 256 + 65536
    40      8     low_water     Q    1: a claimer took from the active set
                                     while no next set was pending, and asks
                                     for one; the keeper takes it (swaps it
                                     back to 0), and every publish clears it
    48      16    reserved
    64            slot 0, then slot 1 at 64 + slot_stride

    slot (records_at = 64 + 32 * capacity + heap_size, rounded up to 64;
          slot_stride = records_at + 8 * capacity, rounded up to 64)
    +0      4     seq           I    seqlock: odd while the keeper writes
    +4      4     count         I    entries in this slot
    +8      8     generation    Q    publishes since the segment was created
    +16     8     published_at  d    wall seconds
    +24     8     claim_cursor  Q    low 32 bits: the index of the next entry
                                     to hand out; claimers fetch-add it
                                     (``take``), so two never take the same
                                     entry of one set; it may run a little
                                     past ``count`` (drained). High 32 bits:
                                     the tag, the even seq the publish ended
                                     on. Every publish of the slot resets it
                                     to (its seq, 0).
    +32     4     heap_used     I    key bytes written
    +36     4     flags         I    bit 0: every key is ASCII
    +40     24    reserved
    +64           entries: capacity x 32 bytes, the first ``count`` valid
    +64+32K       heap: the keys' UTF-8 bytes, in entry order
    +records_at   grant records: capacity x u64, one an entry (below)

    entry (32 bytes)
    +0      4     key_offset    I    into the slot's heap
    +4      2     key_len       H    bytes (contract: at most 1,024)
    +6      2     class_id      H
    +8      8     version       Q
    +16     8     due_minute    q
    +24     8     rank          d

    grant record (u64; 0: none). A claimer that leased entry i writes record
    i once the lease is LEASED: where the keeper finds the key's lease
    without reading the lease slot (shm/leases.py ``excluded_changes``).
    bits 0-22   lease slot index + 1
    bit  23     the lease word's copy bit
    bits 24-43  the lease word's seq
    bits 44-63  the slot's tag (the even seq its publish ended on) >> 1,
                low 20 bits: a record a lapped claimer writes late names
                an older publish, and is ignored
    Every publish of the slot zeroes all its records first.
    Records are hints: the keeper trusts one only while the lease word it
    names is still the slot's word, and reads the slot itself otherwise.

A set whose keys overflow the heap is published short (``publish`` returns
how many entries it wrote), never with a torn key.

Taking entries (``take``): read the active slot's header (seq even, and the
cursor's tag equal to it), fetch-add the cursor, copy the entries taken, and
check the seq again. The value the add returns names the publish it counted
in (its tag): if the slot was republished between the read and the add (the
keeper lapped the claimer), the entries taken are the new set's, and the
claimer copies those. Only a claimer lapped twice inside one take (two more
publishes into that slot, each at least 10 ms apart) loses the entries its add
skipped; they wait for the next publish, never a double grant (every grant is
checked against its row and the lease table anyway). An add that lands while
the keeper is still writing the slot is wiped by the publish's reset, and the
claimer retries.

Memory ordering (docs/shm.md, "Memory ordering"): every load and store that
publishes or checks a seqlock or the switch word goes through ``shm._atomic``
with the fence it needs on a weakly ordered CPU (aarch64); the bulk copies in
between stay Python slices, ordered by those fences. The keeper opens a slot
with ``begin32`` (odd seq, release fence) and ends it with ``release32``;
readers load the seq with acquire and close with ``check32`` (acquire fence,
seq again).
"""

from __future__ import annotations

import os
import struct
import time
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate, repeat
from typing import Any, NamedTuple

from node.core.errors import NodeError
from shm import segment
from shm.segment import HEADER_SIZE, U32, Segment, SnapshotUnstable, segment_name

try:
    from shm import _atomic
except ImportError as _exc:  # reported when a claimer first takes, with what to do
    _atomic = None  # type: ignore[assignment]
    _ATOMIC_IMPORT_ERROR: ImportError | None = _exc
else:
    _ATOMIC_IMPORT_ERROR = None

LAYOUT_VERSION = 4  # 2: tagged claim cursor, low_water; 3: grant records; 4: sets ahead
KIND = "ready"

ACTIVE_OFFSET = HEADER_SIZE  # 24: the switch word (active, generation), a u64
GENERATION_OFFSET = 28
READY_FIELDS = struct.Struct("<II")  # capacity, heap_size at 32
READY_FIELDS_OFFSET = 32
LOW_WATER_OFFSET = 40
FIRST_SLOT = 64

SLOT = struct.Struct("<IIQdQII")  # seq, count, generation, published_at, cursor, heap_used, flags
SLOT_HEADER_SIZE = 64
SLOT_GENERATION = 8  # offset inside a slot
U64 = struct.Struct("<Q")
LOW_WATER = U64
CLAIM_CURSOR = 24  # offset inside a slot
CURSOR_INDEX = (1 << 32) - 1  # the cursor's index bits; the tag is above them
FLAG_ASCII = 1
RECORD = 8  # a grant record's bytes
RECORD_TAG_SHIFT = 44
RECORD_TAG_MASK = (1 << 20) - 1

ENTRY_FORMAT = "IHHQqd"  # key_offset, key_len, class_id, version, due_minute, rank
ENTRY_SIZE = 32
# Heap bytes per entry: keys average far less; the fixed extra covers a few
# long ones even in a small set.
KEY_BYTES_PER_ENTRY = 256
KEY_BYTES_EXTRA = 65536
# A publish is encoded and written CHUNK entries at a time. Whole-set
# intermediates (a 300 KB joined string, 40 KB lists) are fresh allocations that
# glibc hands back to the kernel and faults in again at every publish;
# chunk-sized ones are reused. CHUNK is a power of two: a shorter last chunk is
# packed as a sum of powers of two, so the Structs are precompiled once, nine
# of them, whatever the set sizes.
CHUNK = 256
# A reader gives up after this many torn copies in a row. Each try is one copy
# of at most a slot; the keeper would have to lap the reader this many times.
READ_RETRIES = 1000

ENTRY = struct.Struct("<" + ENTRY_FORMAT)

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


class ReadyEntry(NamedTuple):
    key: str
    version: int
    due_minute: int
    class_id: int
    rank: float


class ReadySnapshot(NamedTuple):
    generation: int
    published_at: float
    entries: list[ReadyEntry]


def heap_size_for(capacity: int) -> int:
    return capacity * KEY_BYTES_PER_ENTRY + KEY_BYTES_EXTRA


def _records_at(capacity: int, heap_size: int) -> int:
    """Where a slot's grant records start, inside the slot."""
    return (SLOT_HEADER_SIZE + ENTRY_SIZE * capacity + heap_size + 63) // 64 * 64


def _slot_stride(capacity: int, heap_size: int) -> int:
    return (_records_at(capacity, heap_size) + RECORD * capacity + 63) // 64 * 64


def record_tag(seq: int) -> int:
    """The tag a grant record carries for a slot whose publish ended on ``seq``."""
    return (seq >> 1) & RECORD_TAG_MASK


def segment_size_for(capacity: int) -> int:
    return FIRST_SLOT + 2 * _slot_stride(capacity, heap_size_for(capacity))


class ReadySet:
    def __init__(self, seg: Segment) -> None:
        if _atomic is None:
            raise NodeError(
                "the C extension shm._atomic is not built (the ready set's fences and "
                "atomics); run `pip install -e .` with gcc and the Python headers "
                f"installed ({_ATOMIC_IMPORT_ERROR})"
            )
        self.segment = seg
        self.capacity, self.heap_size = READY_FIELDS.unpack_from(seg.mm, READY_FIELDS_OFFSET)
        self._stride = _slot_stride(self.capacity, self.heap_size)
        self._heap_at = SLOT_HEADER_SIZE + ENTRY_SIZE * self.capacity  # inside a slot
        self._records_at = _records_at(self.capacity, self.heap_size)  # inside a slot
        # The writer's last publish into each slot: how many entries and its
        # tag (grant_records), and the records' views, made on first use.
        self._slot_publish: list[tuple[int, int] | None] = [None, None]
        #: the slot this handle last published into (the writer's), or None
        self.last_slot: int | None = None
        self._records: list[memoryview] = []
        self._no_records = bytes(RECORD * self.capacity)
        self._stamped_pid = 0
        self._flat = [0] * (6 * CHUNK)
        # The atomics view (claim cursor, low_water), made on first use: a
        # reader that only snapshots never needs the C extension. It holds a
        # buffer export of the mapping, so ``close`` releases it first.
        self._view: Any = None
        #: torn copies retried by this handle's snapshots and takes (a health figure).
        self.retries = 0
        #: switches to a pending set this handle made (a claimer's, or the keeper's)
        self.switches = 0
        #: after each ``take``: the size of the set it took from, and how many
        #: entries of it were left untaken (the claimer's low-water check).
        self.last_count = 0
        self.last_left = 0
        self._on_close: list = []  # callables that release what holds this mapping

    # -- lifecycle (the supervisor creates and unlinks; everyone else attaches) --

    @classmethod
    def create(
        cls, node: str, capacity: int, identity: tuple[bytes, bytes] | None = None
    ) -> ReadySet:
        """Supervisor: create the segment, or reattach the one a crash left
        (``identity``: see ``segment.create_or_reattach``)."""
        if not 1 <= capacity <= 1 << 20:
            raise ValueError(f"ready set capacity {capacity} is not between 1 and {1 << 20}")

        def init(mm) -> None:
            READY_FIELDS.pack_into(mm, READY_FIELDS_OFFSET, capacity, heap_size_for(capacity))

        seg = segment.create_or_reattach(
            segment_name(node, KIND),
            segment_size_for(capacity),
            LAYOUT_VERSION,
            init=init,
            identity=identity,
        )
        return cls(seg)

    @classmethod
    def attach(cls, node: str) -> ReadySet:
        return cls(segment.attach(segment_name(node, KIND), LAYOUT_VERSION))

    @staticmethod
    def unlink(node: str) -> bool:
        """Supervisor only."""
        return segment.unlink(segment_name(node, KIND))

    def on_close(self, release) -> None:
        """Call ``release`` first when this set is closed (a claim path in C
        holds the mapping)."""
        self._on_close.append(release)

    def close(self) -> None:
        while self._on_close:
            self._on_close.pop()()
        while self._records:
            self._records.pop().release()
        if self._view is not None:
            self._view.release()
            self._view = None
        self.segment.close()

    def __enter__(self) -> ReadySet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _slot_base(self, index: int) -> int:
        return FIRST_SLOT + index * self._stride

    # -- writer (the keeper) ----------------------------------------------------

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

    def _publish(self, chunks: Any, now: float, ahead: bool) -> int:
        """Write a set into the slot not active: ``chunks`` are an iterable of
        column chunks (``_write_chunks``), or a tuple of five whole columns as
        lists (``write_entries``)."""
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
        if isinstance(chunks, tuple):  # whole columns, as lists: written in C
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

    def _drained(self, mm: Any, base: int) -> bool:
        """Whether the slot at ``base`` is a finished set with nothing left to take."""
        seq, count, _gen, _at, cursor, _used, _flags = SLOT.unpack_from(mm, base)
        return not seq & 1 and cursor >> 32 == seq and cursor & CURSOR_INDEX >= count

    def _next_generation(self, active: int) -> int | None:
        """The generation of the set the slot not ``active`` holds if it is
        the next set (pending: finished, and one generation newer than the
        active slot's), else None."""
        mm = self.segment.mm
        view = self._view if self._view is not None else self._atomics()
        other = self._slot_base(1 - active)
        seq = view.load32(other)
        _seq, _count, generation, _at, cursor, _used, _flags = SLOT.unpack_from(mm, other)
        current = U64.unpack_from(mm, self._slot_base(active) + SLOT_GENERATION)[0]
        if seq & 1 or cursor >> 32 != seq or generation != current + 1:
            return None
        if not view.check32(other, seq):
            return None  # rewritten under us: not that set
        return generation

    def _switch(self, view: Any, word: int) -> bool:
        """The set the switch word ``word`` names is drained: switch to the
        other slot if that holds the next set (it is pending). True when the
        active slot is no longer the one ``word`` names, whoever switched."""
        generation = self._next_generation(word & 1)
        if generation is None:
            return view.load64(ACTIVE_OFFSET) != word
        new = (1 - (word & 1)) | (generation & 0xFFFFFFFF) << 32
        if view.cas64(ACTIVE_OFFSET, word, new) == word:
            self.switches += 1
            self.segment.futex_wake(GENERATION_OFFSET)
        return True

    def pending(self) -> bool:
        """Whether the slot that is not active holds the next set: finished,
        and one generation newer than the active one (published ahead, and
        not switched to yet)."""
        return self._next_generation(self.active_slot) is not None

    @property
    def active_slot(self) -> int:
        """The slot claimers take from now (0 or 1)."""
        return _atomic.acquire32(self.segment.mm, ACTIVE_OFFSET) & 1

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

    # -- readers ----------------------------------------------------------------

    @property
    def generation(self) -> int:
        """The newest published generation (0 before the first publish)."""
        mm = self.segment.mm
        active = _atomic.acquire64(mm, ACTIVE_OFFSET) & 1
        return _atomic.acquire64(mm, self._slot_base(active) + SLOT_GENERATION)

    def _atomics(self) -> Any:
        if self._view is None:
            if _atomic is None:
                raise NodeError(
                    "the C extension shm._atomic is not built (claims need its atomic "
                    "fetch-add); run `pip install -e .` with gcc and the Python headers "
                    f"installed ({_ATOMIC_IMPORT_ERROR})"
                )
            if self.segment.read_only:
                raise NodeError(
                    f"{self.segment.name} is mapped read-only: it cannot be claimed from"
                )
            self._view = _atomic.View(self.segment.mm)
        return self._view

    def take(self, n: int) -> tuple[int, list[ReadyEntry]]:
        """Take the next ``n`` entries of the active set, in rank order:
        ``(generation, entries)``, fewer than ``n`` when the set runs out.
        A take that finds the active set drained switches to the next set if
        it is pending (``_switch``) and takes from that; none when nothing is
        pending (wait for the next publish with ``wait_publish(generation,
        ...)``).

        No two takes of one set get the same entry, in any process (a
        fetch-add on the slot's claim cursor). Raises SnapshotUnstable if the
        keeper laps this reader ``READ_RETRIES`` times in a row.
        """
        if n <= 0:
            return self.generation, []
        view = self._view if self._view is not None else self._atomics()
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

    def take_low_water(self) -> bool:
        """Keeper: whether a claimer asked for a republish; clears the request."""
        return self._atomics().cas64(LOW_WATER_OFFSET, 1, 0) == 1

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


def _check_c_layout() -> None:
    """The C claim path's offsets are these (shm/_claim_path.c, READY_LAYOUT)."""
    try:
        from shm import _claim  # type: ignore[attr-defined]
    except ImportError:
        return  # no C claim path: nothing else reads the set by offsets
    segment.check_layout("shm._claim", _claim.READY_LAYOUT, globals())


_check_c_layout()
