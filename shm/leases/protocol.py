"""The lease table's layout and state word: every offset, code and struct,
and the small pieces of the protocol that are not the table's methods (who
holds a slot, the next-expiry hint). How the protocol works: shm/leases/__init__.py.

Layout (little-endian, every field naturally aligned)::

    segment header
    offset  size  field           format
    0       24    common header (magic, layout, writer pid, owner pid, size;
                  see shm/segment.py)
    24      4     capacity        I    slots, a power of two
    28      4     long_blocks     I    overflow blocks for keys over 208 bytes
    32      4     max_misses      I    misses in a row before a key is parked
    36      4     sealed          I    1: the node stopped granting from this
                                       table (``seal``); 0 at create and reattach
    40      8     next_lease_id   Q    fetch-add (lease ids, insert tickets);
                                       seeded with wall microseconds
    48      8     refused_full    Q    grants refused because every slot was taken
    56      8     grants          Q    base: counted before this table (a saved
                                       table's, put back by ``load``); the
                                       counts since are in the shards
    64      8     reclaimed       Q    slots taken back from dead processes
    72      8     backoffs        Q    concurrent inserts of one key resolved
    80      8     released        Q    base of: leases handed back without a result
    88      8     expired         Q    base of: leases the sweep found past their expiry
    96      8     completed       Q    base of: results that ended a live lease
    104     8     late_expired    Q    base of: results accepted for an expired
                                       lease (it moves from expired to finished)
    112     8     late_released   Q    base of: results accepted for a released lease
    120     8     earliest_expiry Q    the next-expiry hint (EARLIEST_EXPIRY)
    128           states:  capacity x Q   state words (below)
    ...           hashes:  capacity x Q   key hash, valid while the slot is keyed
    ...           maxdist: capacity x I   per home slot, padded to 64
    ...           owners:  long_blocks x Q  block owner: slot index + 1, 0 free
    ...           slots:   capacity x 512 bytes (below), from a multiple of 64
    ...           blocks:  long_blocks x 816 bytes: a long key's bytes 208..1023
    ...           shards:  from a multiple of 64: a 64-byte header (+0 used, I:
                           shards ever handed out), then MAX_SHARDS x 64 bytes

    counter shard (64 bytes; one per process that counts, written by it alone)
    +0      8     owner           Q    the process's pid and tag, as a state word
                                       holds them (bits 9-43); 0 never used
    +8      8     grants          Q    counts since the table was made
    +16     8     completed       Q
    +24     8     released        Q
    +32     8     expired         Q
    +40     8     late_expired    Q
    +48     8     late_released   Q
    +56     8     journal         Q    0, or the counted publish in progress:
                                       counter k (bits 0-2), slot (3-24), the
                                       published word's seq (25-44), the low 19
                                       bits of the count it brings k to (45-63)

    state word (Q)
    bits   0-3   code    0 EMPTY, 1 FREE, 2 CLAIMING, 3 UPDATING, 4 IDLE,
                         5 LEASED, 6 HELD, 7 PARKED
    bits   4-7   prev    UPDATING only: the code to restore on rollback
    bit    8     copy    which record copy is current
    bits   9-30  pid     CLAIMING/UPDATING: the holder (pids fit 22 bits)
    bits  31-43  tag     the holder's start time in clock ticks, mod 8192
    bits  44-63  seq     +1 at every change (a reader's consistency check)

    slot (512 bytes)
    +0      2     key_len         H    UTF-8 bytes, 1..1024
    +2      2     reserved
    +4      4     block           I    overflow block index + 1; 0 none
    +8      8     ticket          Q    an insert's rank among racing inserts of
                                       one key (lower wins); 0 until drawn
    +16     208   key             208s the key's first 208 bytes
    +224    144   record copy 0
    +368    144   record copy 1

    record (144 bytes)
    +0      8     lease_id        Q
    +8      8     granted_at      d    wall seconds
    +16     8     expires_at      d
    +24     8     held_until      d    0 when not held
    +32     8     lease_s         d    the lease's length, for the hold
    +40     8     cadence_s       d    the row's cadence: the hold's cap
    +48     4     misses          I    in a row
    +52     1     ended           B    how the last lease ended (Ended)
    +53     1     consumer_len    B
    +54     1     error_len       B
    +55     1     reserved
    +56     32    consumer        32s  UTF-8, truncated
    +88     48    last_error      48s  UTF-8, truncated
    +136    8     version         Q    the row's version when it was granted
                                       (the write-back of its next due time is
                                       conditional on it)

States: EMPTY never used; FREE given back; CLAIMING a process is giving the
slot a new key; UPDATING a process is changing it (``prev`` says what it was,
and its current record still stands); IDLE keyed, nothing live, no misses (any
new key may take the slot); LEASED; HELD missed, not leased, grantable once
``held_until`` passes; PARKED. A key's bytes and hash change only while a
process holds its slot CLAIMING.
"""

from __future__ import annotations

import enum
import hashlib
import os
import struct
import time
from typing import Any, NamedTuple

from node.core.errors import NodeError
from shm.leases import test_stops
from shm.segment import HEADER_SIZE, pid_alive

try:
    _atomic = test_stops.extension("_atomic")
except ImportError as _exc:  # reported when a table is opened, with what to do
    _atomic = None  # type: ignore[assignment]
    _ATOMIC_IMPORT_ERROR: ImportError | None = _exc
else:
    _ATOMIC_IMPORT_ERROR = None
try:
    # The grant's common cases and the key hash in C (shm/_claim.c); without
    # it every grant takes the Python path (grant.py), the same protocol.
    _claim = test_stops.extension("_claim")
except ImportError:
    _claim = None  # type: ignore[assignment]
test_stops.check_build(_atomic, _claim)

LAYOUT_VERSION = 3  # 3: the seal and the counter shards
KIND = "leases"

# Slots for live, held and parked keys. Completed keys free theirs, so this
# bounds leases plus misses, not rows.
DEFAULT_CAPACITY = 65_536
MAX_CAPACITY = 1 << 22
DEFAULT_MAX_MISSES = 10
MAX_KEY_BYTES = 1024
# Keys up to INLINE_KEY bytes live in the slot; longer ones continue in an
# overflow block. URLs are rarely longer, so one block per 8 slots by default.
INLINE_KEY = 208
BLOCK_SIZE = MAX_KEY_BYTES - INLINE_KEY  # 816
CONSUMER_BYTES = 32
ERROR_BYTES = 48
# How long complete/release/renew/unhold wait for a live process that holds
# the key's slot mid-change (microseconds, normally) before answering BUSY.
BUSY_WAIT_S = 0.5
# Attempts of a grant that loses an insert race, before it answers BUSY.
INSERT_RETRIES = 4
# How often wait_settled looks again for slots held mid-change.
SETTLE_POLL_S = 0.001
# Counter shards: one per process that counts (the processes of a node are a
# few dozen; each test process of a table takes one too).
MAX_SHARDS = 1024
# Torn reads of one slot in a row before a reader treats it as busy.
READ_RETRIES = 100
# Reads of a changing slot in the C scan of excluded_keys before it leaves
# the slot to _stable.
SCAN_RETRIES = 4

# -- layout -------------------------------------------------------------------

TABLE_FIELDS = struct.Struct("<III")  # capacity, long_blocks, max_misses at 24
TABLE_FIELDS_OFFSET = HEADER_SIZE
SEALED = 36
NEXT_LEASE_ID = 40
REFUSED_FULL = 48
GRANTS = 56
RECLAIMED = 64
BACKOFFS = 72
RELEASED = 80
EXPIRED = 88
COMPLETED = 96
LATE_EXPIRED = 104
LATE_RELEASED = 112
# A lower bound on the expiry of every live lease: an f64's bits (positive
# doubles order as their bits), 0 unknown. Whoever publishes a lease LEASED
# lowers it after (``_lower_expiry``; the C grant too); a sweep sets it to inf
# before its scan and lowers it to what the scan left. ``expire`` skips the scan
# while ``now`` is below it, but not for longer than FULL_SCAN_S: a writer
# killed between its publish and its lowering costs that lease at most that
# much lateness.
EARLIEST_EXPIRY = 120
FULL_SCAN_S = 1.0
_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")
_INF_BITS = _U64.unpack(_F64.pack(float("inf")))[0]
# The lifetime counters of the ledger that live in this table, by name: the
# base's offset in the header (all but refused_full also count in the shards).
COUNTERS = {
    "grants": GRANTS,
    "released": RELEASED,
    "expired": EXPIRED,
    "completed": COMPLETED,
    "late_expired": LATE_EXPIRED,
    "late_released": LATE_RELEASED,
    "refused_full": REFUSED_FULL,
}
STATES = 128
# Counter shards (offset table above): the counters that count in them, by
# their index k in a shard (8 * k is the offset, as shm/_claim.h COUNT_*).
SHARDS_HEADER = 64
SHARD_SIZE = 64
SHARD_JOURNAL = 56
SHARD_COUNTS = ("grants", "completed", "released", "expired", "late_expired", "late_released")
(
    COUNT_GRANTS,
    COUNT_COMPLETED,
    COUNT_RELEASED,
    COUNT_EXPIRED,
    COUNT_LATE_EXPIRED,
    COUNT_LATE_RELEASED,
) = range(1, 7)
_TARGET_MASK = (1 << 19) - 1
_SLOT_MASK = (1 << 22) - 1
OWNER_MASK = ((1 << 35) - 1) << 9  # a state word's pid and tag

SLOT_SIZE = 512
KEY_META = struct.Struct("<HHI")  # key_len, reserved, block
TICKET_AT = 8
KEY_AT = 16
COPY_AT = (224, 368)
RECORD = struct.Struct("<QdddddIBBBx32s48sQ")
EXPIRES_AT = 16  # offsets inside a record, for the scans
HELD_UNTIL = 24
assert RECORD.size == 144 and KEY_AT + INLINE_KEY == COPY_AT[0]

EMPTY, FREE, CLAIMING, UPDATING, IDLE, LEASED, HELD, PARKED = range(8)
CODE_NAMES = ("empty", "free", "claiming", "updating", "idle", "leased", "held", "parked")


def _mask(*codes: int) -> int:
    return sum(1 << c for c in codes)


KEYED = _mask(UPDATING, IDLE, LEASED, HELD, PARKED)
REUSABLE = _mask(EMPTY, FREE, IDLE)
BUSY_CODES = (CLAIMING, UPDATING)
SEQ_SHIFT = 44
SEQ_MASK = (1 << 20) - 1
TAG_MASK = (1 << 13) - 1


def _word(code: int, copy: int, seq: int, prev: int = 0, owner: int = 0) -> int:
    """A state word; ``owner`` is the holder's pid and tag, already shifted."""
    return code | prev << 4 | copy << 8 | owner | (seq & SEQ_MASK) << SEQ_SHIFT


def _next(w: int, code: int, copy: int, prev: int = 0, owner: int = 0) -> int:
    return _word(code, copy, (w >> SEQ_SHIFT) + 1, prev, owner)


def _copy(w: int) -> int:
    return (w >> 8) & 1


class _Layout(NamedTuple):
    capacity: int
    long_blocks: int
    hashes: int
    maxdist: int
    owners: int
    slots: int
    blocks: int
    shards: int
    size: int


def _layout(capacity: int, long_blocks: int) -> _Layout:
    hashes = STATES + 8 * capacity
    maxdist = hashes + 8 * capacity
    owners = (maxdist + 4 * capacity + 63) // 64 * 64
    slots = (owners + 8 * long_blocks + 63) // 64 * 64
    blocks = slots + SLOT_SIZE * capacity
    shards = (blocks + BLOCK_SIZE * long_blocks + 63) // 64 * 64
    return _Layout(
        capacity,
        long_blocks,
        hashes,
        maxdist,
        owners,
        slots,
        blocks,
        shards,
        shards + SHARDS_HEADER + SHARD_SIZE * MAX_SHARDS,
    )


def segment_size_for(capacity: int, long_blocks: int | None = None) -> int:
    return _layout(capacity, capacity // 8 if long_blocks is None else long_blocks).size


# -- errors and records ---------------------------------------------------------


class AtomicsMissing(NodeError):
    """The ``shm._atomic`` extension is not built."""


class SlotTakenOver(NodeError):
    """Another process took a slot this process held: it judged this process
    dead. Cannot happen unless pids are shared across hosts or namespaces."""


class Ended(enum.IntEnum):
    """How a key's last lease ended (``ended`` in the record)."""

    LIVE = 0
    RESULT = 1
    RELEASED = 2
    EXPIRED = 3


class _Record(NamedTuple):
    lease_id: int
    granted_at: float
    expires_at: float
    held_until: float
    lease_s: float
    cadence_s: float
    misses: int
    ended: int
    consumer_len: int
    error_len: int
    consumer: bytes
    error: bytes
    version: int

    @property
    def consumer_str(self) -> str:
        return self.consumer[: self.consumer_len].decode("utf-8", "replace")

    @property
    def error_str(self) -> str:
        return self.error[: self.error_len].decode("utf-8", "replace")


_BLANK = _Record(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0, b"", b"", 0)
# _Record from RECORD's 13 values, without _make's Python-level call.
_new_record = tuple.__new__


def truncated(text: str | None, limit: int) -> bytes:
    """``text``'s UTF-8 cut to at most ``limit`` bytes, never mid-character."""
    raw = (text or "").encode()
    if len(raw) <= limit:
        return raw
    return raw[:limit].decode("utf-8", "ignore").encode()  # never half a character


_blake2b = hashlib.blake2b


def _hash_py(key: bytes) -> int:
    return int.from_bytes(_blake2b(key, digest_size=8).digest(), "little")


# The same value (tests/integration/test_grant_c.py compares them), a third of the cost.
_hash = _hash_py if _claim is None else _claim.blake2b64


def _key_bytes(key: str) -> bytes:
    raw = key.encode()
    if not 0 < len(raw) <= MAX_KEY_BYTES:
        raise ValueError(f"a key is 1 to {MAX_KEY_BYTES} UTF-8 bytes, not {len(raw)}")
    return raw


# -- who holds a slot ------------------------------------------------------------


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])  # field 22 of stat(5), counting from after the comm


def _owner_alive(w: int) -> bool:
    """Whether the process named in a CLAIMING/UPDATING word still runs.

    The word carries the pid and 13 bits of the process's start time, so a pid
    reused by a later process reads as dead, unless it started a multiple of
    8192 ticks (82 s at 100 Hz) after the holder, to the tick.
    """
    pid = (w >> 9) & 0x3FFFFF
    if not pid_alive(pid):
        return False
    ticks = _start_ticks(pid)
    if ticks is None:
        return os.path.exists(f"/proc/{pid}")  # unreadable: assume it runs
    return ticks & TAG_MASK == (w >> 31) & TAG_MASK


_me = 0  # this process's pid and tag, shifted; 0 until asked for


def _forget_me() -> None:
    global _me
    _me = 0


# A child of os.fork (multiprocessing's fork included) works out its own; this
# saves a getpid system call (~0.2 us) in every grant and completion.
os.register_at_fork(after_in_child=_forget_me)


def owner_bits() -> int:
    """This process as a state word's pid and tag (recomputed after a fork)."""
    global _me
    if not _me:
        pid = os.getpid()
        if pid >= 1 << 22:
            raise NodeError(f"pid {pid} does not fit the lease table's 22 bits")
        _me = pid << 9 | ((_start_ticks(pid) or 0) & TAG_MASK) << 31
    return _me


def _require_atomics() -> None:
    if _atomic is None:
        raise AtomicsMissing(
            "the C extension shm._atomic is not built (it gives the lease table "
            "compare-and-swap); run `pip install -e .` with gcc and the Python headers "
            f"installed ({_ATOMIC_IMPORT_ERROR})"
        )


def _pause(deadline: float) -> None:
    """One step of waiting for another process to finish with a slot: a
    yield while the wait is young (holders take microseconds), then short
    sleeps, so that waiting on a stopped holder does not burn a CPU."""
    if deadline - time.monotonic() > BUSY_WAIT_S - 0.001:
        os.sched_yield()
    else:
        time.sleep(0.0002)


def _bump(view: Any, offset: int) -> None:
    view.add64(offset, 1)


def _lower_expiry(view: Any, expires_at: float) -> None:
    """EARLIEST_EXPIRY = min(itself, expires_at), by compare-and-swap."""
    bits = _U64.unpack(_F64.pack(expires_at))[0]
    cur = view.load64(EARLIEST_EXPIRY)
    while bits < cur:
        got = view.cas64(EARLIEST_EXPIRY, cur, bits)
        if got == cur:
            return
        cur = got
