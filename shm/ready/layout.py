"""The ready set's protocol and layout: the one place its offsets are written
(in Python; shm/_claim_path.c has them too, checked at import below).

The ready set: the best K due keys, published by the keeper, read by claimers.

``/queue-node.<name>.ready``. The supervisor creates and unlinks it; the keeper
is its only writer of entries (publishing from two processes at once would
break the seqlocks); claimers and the console attach and close. Claimers write
two words only: a slot's ``claim_cursor`` and the header's ``low_water``, both
with atomic read-modify-writes (``shm._atomic``). Whoever renews the node's
fleet membership writes one more, ``grant_until`` (``set_grant_until``); every
take reads it.

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
    48      8     grant_until   Q    the grant deadline: CLOCK_MONOTONIC
                                     nanoseconds (system-wide on Linux;
                                     Python's time.monotonic_ns()) from
                                     which no take hands out an entry; 0:
                                     none (a single node). Written by
                                     whoever renews the node's membership
                                     (docs/fleet.md), with a store
    56      8     reserved
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
    without reading the lease slot (shm/leases/ ``excluded_changes``).
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
check the seq again. Before all that, a take reads ``grant_until`` and
refuses (``NotGranting``) once the monotonic clock has reached it: a node that
cannot renew its membership stops granting before another node can own its
rows (docs/fleet.md). The value the add returns names the publish it counted
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

The code: ``shm/ready/base.py`` (lifecycle, the switch), ``publish.py`` (the
keeper's side), ``take.py`` (the claimers' side and snapshots); ``ReadySet``
(``shm/ready/readyset.py``) is all three.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from shm import layout as _layout
from shm.segment import HEADER_SIZE

# 2: tagged claim cursor, low_water; 3: grant records; 4: sets ahead; 5: the
# grant deadline (a claimer of an older build would not check it: refused).
LAYOUT_VERSION = 5
KIND = "ready"

ACTIVE_OFFSET = HEADER_SIZE  # 24: the switch word (active, generation), a u64
GENERATION_OFFSET = 28
READY_FIELDS = struct.Struct("<II")  # capacity, heap_size at 32
READY_FIELDS_OFFSET = 32
LOW_WATER_OFFSET = 40
GRANT_UNTIL_OFFSET = 48  # u64, CLOCK_MONOTONIC ns; 0: no deadline
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


# Every built C module's ready-set offsets are these (shm/layout.h, checked by
# shm/layout.py): a build of another layout fails here, at import.
_layout.check_ready(globals())
