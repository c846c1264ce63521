"""The lease table: exclusive, time-limited grants of keys, in shared memory.

``/queue-node.<name>.leases``. The supervisor creates it (reattaching what a
crash left), loads the leases a clean shutdown saved, and at the next clean
shutdown saves them and unlinks it. Every process of the node attaches and may
write: claimers grant, HTTP workers complete, release and renew, the keeper
sweeps expiries and reads the excluded keys for its publish.

No locks. Every change to a slot is a compare-and-swap on the slot's state
word (``shm._atomic``, a C extension; why: docs/leases.md): a process takes a
slot by swapping its word to UPDATING (or CLAIMING, for a slot it is giving a
new key) with its pid in it, writes, and publishes the next state with a
second swap. A process that dies holding a slot leaves its pid there; anyone
who meets the slot and finds that pid dead (or reused, see ``_owner_alive``)
swaps it back. An update writes the *inactive* copy of the slot's record and
flips to it when it publishes, so rolling back a dead updater is just
restoring the old word: the old record is intact. A live holder is never
robbed, however long it takes: were it robbed and then resumed, it would write
over the next holder's record.

Finding a key: open addressing, linear probing from ``hash % capacity`` (a
64-bit blake2b of the key's UTF-8; Python's ``hash`` differs per process).
Freed slots keep no tombstone chains: a probe for key K visits
``maxdist[home] + 1`` slots, where ``maxdist[home]`` is the farthest any key
with that home was ever placed. So a probe is short at any occupancy, and a
new key may take any free slot in the whole table: a grant is refused only
when every slot is taken.

Sealed: at a clean shutdown the supervisor seals the table (``seal``, then
``wait_settled``) before it saves it, so that a process that outlives the
node's restart never grants from (or changes) the old table. Every change a
process makes on behalf of a caller (grant, renew, release, complete,
unhold) reads the seal right after its swap took the slot, and if sealed puts
the word back as it found it and raises NodeRestarted. The swap is a full
barrier, and so is the sealer's store: either the change sees the seal, or
``wait_settled`` sees its slot mid-change and waits for it. The keeper's
sweep (``expire``) and the rollback of dead holders still run on a sealed
table; reads (``save`` too) always do.

Counting: the lifetime counters (grants, completed, released, expired and
the late results) are the header's base plus a counter shard per process (a
64-byte line only its process writes). A change that counts is published and
counted in one call into C (``lease_publish_counted`` in shm/_claim.h): the
shard's journal names the publish before the swap and is cleared after the
count, so a kill between the two leaves the journal saying what is missing,
and whoever reads the counters, or takes the dead process's shard over,
applies it (``_settle``). Why and every kill point: docs/leases.md.

One key, one slot. Two processes may insert the same new key at once. Each
writes its key into its CLAIMING slot, raises ``maxdist`` to cover it, makes
the slot keyed (UPDATING, a full barrier), draws a ticket from the lease-id
counter, and only then probes for another keyed slot with the same key. Of two
such inserts at least one sees the other (Dekker); one that sees a settled
slot, or an insert with a lower ticket, backs off. If only one of two sees the
other, the unseen one drew the lower ticket, so exactly one insert proceeds.

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
import importlib
import importlib.machinery
import importlib.util
import os
import signal
import struct
import sys
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgpack

from node.core.errors import NodeError, NodeRestarted
from shm import segment
from shm.segment import HEADER_SIZE, Segment, pid_alive, segment_name

# Tests only: a directory holding the test build of shm's extensions (setup.py
# with QUEUE_NODE_TEST_STOPS=1), loaded instead of the installed ones.
_TEST_BUILD = os.environ.get("QUEUE_NODE_TEST_BUILD", "")


def _extension(name: str) -> Any:
    """``shm.<name>``, or its test build from QUEUE_NODE_TEST_BUILD."""
    if not _TEST_BUILD:
        return importlib.import_module(f"shm.{name}")
    import shm

    path = os.path.join(_TEST_BUILD, "shm", name + importlib.machinery.EXTENSION_SUFFIXES[0])
    spec = importlib.util.spec_from_file_location(f"shm.{name}", path)
    if spec is None or spec.loader is None or not os.path.exists(path):
        raise ImportError(f"QUEUE_NODE_TEST_BUILD={_TEST_BUILD}: no {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # workers/claim.py's ``from shm import _claim`` must find this one: its
    # ClaimPath takes this module's Granter.
    sys.modules[spec.name] = module
    setattr(shm, name, module)
    return module


try:
    _atomic = _extension("_atomic")
except ImportError as _exc:  # reported when a table is opened, with what to do
    _atomic = None  # type: ignore[assignment]
    _ATOMIC_IMPORT_ERROR: ImportError | None = _exc
else:
    _ATOMIC_IMPORT_ERROR = None
try:
    # The grant's common cases and the key hash in C (shm/_claim.c); without
    # it every grant takes the Python path below, the same protocol.
    _claim = _extension("_claim")
except ImportError:
    _claim = None  # type: ignore[assignment]

LAYOUT_VERSION = 3  # 3: the seal and the counter shards
KIND = "leases"
FILE_FORMAT = "queue-node.leases"
FILE_VERSION = 2

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


# -- public types ---------------------------------------------------------------


class AtomicsMissing(NodeError):
    """The ``shm._atomic`` extension is not built."""


class SlotTakenOver(NodeError):
    """Another process took a slot this process held: it judged this process
    dead. Cannot happen unless pids are shared across hosts or namespaces."""


class Refuse(enum.Enum):
    LEASED = "leased"  # a lease on the key is live (or expired, not yet swept)
    HELD = "held"  # the key missed and its hold has not passed
    PARKED = "parked"  # max_misses misses in a row: until unhold or a new write
    FULL = "full"  # every slot is taken (counted in the header)
    BUSY = "busy"  # another process is changing this key's slot right now


@dataclass(frozen=True, slots=True)
class Refused:
    """What ``grant`` answers instead of a Lease. Falsy, like None."""

    reason: Refuse

    def __bool__(self) -> bool:
        return False


class Lease(NamedTuple):
    key: str
    lease_id: int
    consumer: str
    granted_at: float
    expires_at: float
    misses: int  # misses in a row before this lease
    version: int = 0  # the row's version when granted
    cadence_s: float = 0.0  # the row's cadence when granted


class Outcome(enum.Enum):
    COMPLETED = "completed"  # complete: the lease was live (or expired, unswept)
    LATE = "late"  # complete: it had expired or been released; not granted since
    REPEAT = "repeat"  # complete: this lease already ended with a result
    RELEASED = "released"  # release: a miss recorded
    RENEWED = "renewed"  # renew: expires_at = now + lease_s
    ENDED = "ended"  # release/renew: the lease is no longer live; nothing changed
    SUPERSEDED = "superseded"  # the key was granted to a newer lease since
    UNKNOWN = "unknown"  # the table has no such lease for this key
    BUSY = "busy"  # a live process kept the slot longer than BUSY_WAIT_S


class Ended(enum.IntEnum):
    """How a key's last lease ended (``ended`` in the record)."""

    LIVE = 0
    RESULT = 1
    RELEASED = 2
    EXPIRED = 3


class Expired(NamedTuple):
    key: str
    lease_id: int
    consumer: str
    expires_at: float
    misses: int
    held_until: float
    parked: bool


class Hold(NamedTuple):
    key: str
    lease_id: int
    misses: int
    held_until: float
    parked: bool
    last_error: str


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


# The same value (tests/test_grant_c.py compares them), a third of the cost.
_hash = _hash_py if _claim is None else _claim.blake2b64


def _key_bytes(key: str) -> bytes:
    raw = key.encode()
    if not 0 < len(raw) <= MAX_KEY_BYTES:
        raise ValueError(f"a key is 1 to {MAX_KEY_BYTES} UTF-8 bytes, not {len(raw)}")
    return raw


def hold_s(misses: int, lease_s: float, cadence_s: float) -> float:
    """After ``misses`` misses in a row: 2, 4, 8, ... lease lengths, capped at the cadence."""
    return min(2.0 ** min(misses, 60) * lease_s, cadence_s)


# -- who holds a slot ------------------------------------------------------------

# Tests only: "<point>:<stop|exit|pause>". The Python paths check it at each
# point; the C paths only in the test build (QUEUE_NODE_TEST_BUILD), the
# production build has no stop compiled in. The points of a counted publish
# (below) are in C only, for the Python paths too.
_TEST_STOP = os.environ.get("QUEUE_NODE_TEST_LEASE_STOP", "")


# shm/_claim.h P_*: journaled, published and counted are the three kill
# points of a counted publish (before its swap, between its swap and its
# count, before its journal is cleared), in C for every path.
_C_POINTS = {
    "insert": 1,
    "keyed": 2,
    "update": 3,
    "written": 4,
    "published": 5,
    "journaled": 6,
    "counted": 7,
}


def _c_stop(spec: str) -> int:
    """The test stop as shm/_claim.h takes it: point | how << 4; 0 for none."""
    where, _, how = spec.partition(":")
    point = _C_POINTS.get(where, 0)
    return point and point | {"exit": 1, "pause": 2}.get(how, 0) << 4


C_STOP = _c_stop(_TEST_STOP)  # also the claim path's in C (workers/claim.py)
if _TEST_STOP and not all(
    getattr(module, "TEST_STOPS", 1) for module in (_atomic, _claim) if module is not None
):
    # A stop asked for and compiled out would let the test pass without it.
    raise RuntimeError(
        "QUEUE_NODE_TEST_LEASE_STOP needs the test build of shm's extensions "
        "(QUEUE_NODE_TEST_BUILD; see setup.py)"
    )


def _test_stop(point: str) -> None:
    """Tests only: die, stop or pause between taking a slot and publishing it."""
    where, _, how = _TEST_STOP.partition(":")
    if where == point:
        if how == "exit":
            os._exit(17)
        elif how == "pause":
            time.sleep(0.0005)  # widens a race window
        else:
            os.kill(os.getpid(), signal.SIGSTOP)


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


# What shm._claim.Granter.grant answers instead of a lease.
_C_REFUSED = {
    1: Refused(Refuse.LEASED),
    2: Refused(Refuse.HELD),
    3: Refused(Refuse.PARKED),
}
_C_SLOW = -1
_C_TAKEN_OVER = -2
_C_SEALED = -3
_C_NO_SHARD = -4


# -- the table ---------------------------------------------------------------------


class LeaseTable:
    def __init__(self, seg: Segment) -> None:
        self.segment = seg
        self.mm = seg.mm
        self._view = _atomic.View(seg.mm)
        capacity, long_blocks, _ = TABLE_FIELDS.unpack_from(seg.mm, TABLE_FIELDS_OFFSET)
        self._lay = _layout(capacity, long_blocks)
        self.capacity = capacity
        self._cap_mask = capacity - 1
        # The str of each excluded slot's key from the last excluded_keys call
        # (the keeper's), made at its first call; the C scan owns it and
        # compares each str with the slot's bytes before it gives it again.
        self._key_cache: list[str | None] | None = None
        self._seen: bytearray | None = None  # excluded_changes: each slot's last word
        #: after excluded_changes: how many of its added keys came first from the hints
        self.hinted_added = 0
        # excluded_changes: the keys some slot's cache item holds, and for the
        # few held by more than one slot (for a moment), how many more.
        self._key_slots: set[str] = set()
        self._key_extra: dict[str, int] = {}
        self._full_scan_due = 0.0  # expire: scan at this monotonic time whatever the hint
        self._on_close: list = []  # callables that release what holds this mapping
        # This process's counter shard (its offset) and the owner bits it was
        # taken for: a child of fork takes one of its own (_shard).
        self._shard_at = 0
        self._shard_owner = 0
        lay = self._lay
        self._granter = (
            None
            if _claim is None
            else _claim.Granter(
                seg.mm,
                capacity,
                lay.hashes,
                lay.maxdist,
                lay.owners,
                lay.slots,
                lay.blocks,
                long_blocks,
                lay.size,
            )
        )

    # -- lifecycle (the supervisor creates, loads, saves and unlinks) -------------

    @classmethod
    def create(
        cls,
        node: str,
        capacity: int = DEFAULT_CAPACITY,
        long_blocks: int | None = None,
        max_misses: int = DEFAULT_MAX_MISSES,
        now: float | None = None,
        identity: tuple[bytes, bytes] | None = None,
    ) -> LeaseTable:
        """Supervisor: create the table, or reattach the one a crash left
        (``identity``: see ``segment.create_or_reattach``).

        ``capacity`` is rounded up to a power of two. A table a crash left is
        reattached whatever capacity is asked for now: its leases are evidence
        (``.segment.reattached`` says so). ``max_misses`` always takes effect.
        """
        _require_atomics()
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"lease table capacity {capacity} is not between 1 and {MAX_CAPACITY}")
        if not 1 <= max_misses <= 1000:
            raise ValueError(f"max_misses {max_misses} is not between 1 and 1000")
        capacity = max(16, 1 << (capacity - 1).bit_length())
        blocks = capacity // 8 if long_blocks is None else long_blocks
        name = segment_name(node, KIND)
        try:
            with segment.attach(name, LAYOUT_VERSION) as old:
                capacity, blocks, _ = TABLE_FIELDS.unpack_from(old.mm, TABLE_FIELDS_OFFSET)
        except NodeError:
            pass
        seed = int((time.time() if now is None else now) * 1e6)

        def init(mm) -> None:
            TABLE_FIELDS.pack_into(mm, TABLE_FIELDS_OFFSET, capacity, blocks, max_misses)
            struct.pack_into("<Q", mm, NEXT_LEASE_ID, seed)

        seg = segment.create_or_reattach(
            name, segment_size_for(capacity, blocks), LAYOUT_VERSION, init=init, identity=identity
        )
        struct.pack_into("<I", seg.mm, TABLE_FIELDS_OFFSET + 8, max_misses)
        # Slots are spread by hash: without this nearly every new key's first
        # grant faults in a fresh page of shared memory.
        segment.populate(seg.mm)
        table = cls(seg)
        # A table a crash left sealed (stopped after seal, before unlink) is
        # this node's again: its processes reattach to it.
        table._view.store32(SEALED, 0)
        return table

    @classmethod
    def attach(cls, node: str) -> LeaseTable:
        """Map the node's table. Its pages are mapped in now, as at create
        (each attaching process has page tables of its own): the claimers'
        first touch of a slot's page was a minor fault, one every two or
        three grants of a claim run, about a fifth of a claimer's CPU in the
        claim bench. It costs ~11 ms for the default 65,536 slots at attach,
        ~80 ms for 524,288."""
        _require_atomics()
        table = cls(segment.attach(segment_name(node, KIND), LAYOUT_VERSION))
        segment.populate(table.segment.mm)
        return table

    @staticmethod
    def unlink(node: str) -> bool:
        """Supervisor only, after ``save``."""
        return segment.unlink(segment_name(node, KIND))

    def on_close(self, release) -> None:
        """Call ``release`` first when this table is closed (a claim path
        in C holds the mapping)."""
        self._on_close.append(release)

    def close(self) -> None:
        while self._on_close:
            self._on_close.pop()()
        self._key_cache = None
        self._seen = None
        if self._granter is not None:
            self._granter.release()
        self._view.release()
        self.segment.close()

    def __enter__(self) -> LeaseTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<LeaseTable {self.segment.name} {self.capacity} slots>"

    @property
    def max_misses(self) -> int:
        return TABLE_FIELDS.unpack_from(self.mm, TABLE_FIELDS_OFFSET)[2]

    # -- the seal (the supervisor, at a clean shutdown) ---------------------------

    @property
    def sealed(self) -> bool:
        return bool(self._view.load32(SEALED))

    def seal(self) -> None:
        """Supervisor: no process may change this table on anyone's behalf
        from now on: grants, renewals, releases, completions and unholds
        raise NodeRestarted (the C claim path ends its claim with
        RuntimeError("sealed")). The sweep still runs; reads always do.
        Call ``wait_settled`` next: a change that took its slot before the
        seal may still be publishing."""
        self._view.store32(SEALED, 1)  # a full fence after it (Dekker, with _take)

    def wait_settled(self, deadline_s: float) -> bool:
        """After ``seal``: wait until no slot is held mid-change by a live
        process (a dead holder's slot is rolled back, as everywhere), until
        ``deadline_s`` (a ``time.monotonic()`` value, as the supervisor's
        shared drain deadline). True when settled. False when a live holder
        (a stopped process, say) still held a slot at the deadline: its slot
        is then taken back as if it had died, so its publish can no longer
        succeed (its compare-and-swap finds another word; it gets
        SlotTakenOver). Either way, from the return on nothing but the sweep
        changes the table, and every publish that happened is counted
        (``_settle_all``): a save now holds exactly what the table holds."""
        if not self.sealed:
            raise NodeError(f"{self.segment.name}: wait_settled before seal waits for nothing")
        busy = _mask(*BUSY_CODES)
        while True:
            held = False
            for idx, w in self._view.scan_codes(STATES, self.capacity, busy):
                if _owner_alive(w):
                    held = True
                else:
                    self._reclaim(idx, w)
            if not held:
                self._settle_all()
                return True
            if time.monotonic() >= deadline_s:
                for idx, w in self._view.scan_codes(STATES, self.capacity, busy):
                    self._reclaim(idx, w)  # live or not: the seal outranks it
                self._settle_all()
                return False
            time.sleep(SETTLE_POLL_S)  # a holder takes microseconds, or is stopped

    def _settle_all(self) -> None:
        """Count every publish that swapped and is not counted yet, whoever
        made it (a live process stopped between its swap and its count too):
        settling is idempotent (the count is compared with the journal's
        target), so the process's own late count changes nothing."""
        view = self._view
        first, used = self._lay.shards + SHARDS_HEADER, view.load32(self._lay.shards)
        _sums, pending = view.shard_counts(first, used)
        for i in pending:
            at = first + SHARD_SIZE * i
            owner = view.load64(at)
            if owner:
                self._settle(at, owner)

    def _refuse_sealed(self, idx: int, own: int, w: int) -> None:
        """The table is sealed: put back the word a change found in slot
        ``idx`` (it wrote nothing yet; -1: it holds none) and say so."""
        if idx >= 0 and self._view.cas64(STATES + 8 * idx, own, w) != own:
            raise SlotTakenOver(f"{self.segment.name}: slot {idx} was taken while held")
        raise NodeRestarted(
            f"{self.segment.name} is sealed: the node that owns it stopped granting from "
            "it; reattach to the running node's tables"
        )

    # -- counter shards -------------------------------------------------------------

    def _shard(self, sweep: bool = False) -> int:
        """This process's counter shard: the offset of its line, taken at the
        first change it counts (again in a child of fork). On a sealed table
        only the ``sweep`` takes one (anything else is refused anyway)."""
        me = owner_bits()
        if self._shard_owner != me:
            if not sweep and self.sealed:
                self._refuse_sealed(-1, 0, 0)
            self._shard_at = self._take_shard(me)
            self._shard_owner = me
            if self._granter is not None:
                self._granter.set_shard(self._shard_at, me)
        return self._shard_at

    def _take_shard(self, me: int) -> int:
        """A shard for ``me``: the one it has already (another table object
        of this process), a free one, or a dead process's, settled first."""
        view, header = self._view, self._lay.shards
        first = header + SHARDS_HEADER
        used = view.load32(header)
        for i in range(used):
            if view.load64(first + SHARD_SIZE * i) == me:
                return first + SHARD_SIZE * i
        for i in range(MAX_SHARDS):
            at = first + SHARD_SIZE * i
            owner = view.load64(at)
            if owner and _owner_alive(owner):
                continue
            if owner:
                self._settle(at, owner)  # its counts stay; they go on from there
            if view.cas64(at, owner, me) == owner:
                view.max32(header, i + 1)
                return at
        raise NodeError(
            f"{self.segment.name}: all {MAX_SHARDS} counter shards belong to live processes"
        )

    def _settle(self, at: int, owner: int) -> None:
        """Count what the dead ``owner`` published and did not count: its
        shard's journal names the publish; the slot tells whether it happened.

        Not counted and the slot still held by ``owner`` one seq before the
        journal's: it died before its swap (nothing to count; the slot is
        rolled back as any). Otherwise the swap happened: a rollback of the
        slot would have cleared the journal first (``_drop_journal``). Every
        step is a compare-and-swap that only one settler wins, and the count
        is compared with the journal's target, so settling twice counts once.

        A process takes a dead one's shard over only after settling it, and
        writes a journal only after it took it: so a journal read before the
        owner is still ``owner``'s, and a settler that finds another owner
        stops (its stale swaps of the count and journal can no longer match)."""
        view = self._view
        while True:
            journal = view.load64(at + SHARD_JOURNAL)
            if not journal or view.load64(at) != owner:
                return
            k, idx = journal & 7, (journal >> 3) & _SLOT_MASK
            seq, target = (journal >> 25) & SEQ_MASK, journal >> 45
            count_at = at + 8 * k
            count = view.load64(count_at)
            if count & _TARGET_MASK != target and idx < self.capacity:
                w = self._state(idx)
                before_swap = (
                    w & 15 == UPDATING
                    and w & OWNER_MASK == owner
                    and ((w >> SEQ_SHIFT) + 1) & SEQ_MASK == seq
                )
                if view.load64(at + SHARD_JOURNAL) != journal:
                    continue  # a rollback cleared it under us: look again
                if not before_swap:
                    view.cas64(count_at, count, count + 1)
            view.cas64(at + SHARD_JOURNAL, journal, 0)

    def _drop_journal(self, idx: int, w: int) -> None:
        """Before rolling back slot ``idx``, left UPDATING (``w``) by a dead
        process: clear that process's journal if it names this change, so
        that ``_settle`` never counts a publish that did not happen."""
        owner, seq = w & OWNER_MASK, ((w >> SEQ_SHIFT) + 1) & SEQ_MASK
        view, header = self._view, self._lay.shards
        first = header + SHARDS_HEADER
        for i in range(view.load32(header)):
            at = first + SHARD_SIZE * i
            if view.load64(at) != owner:
                continue
            journal = view.load64(at + SHARD_JOURNAL)
            if journal and (journal >> 3) & _SLOT_MASK == idx and (journal >> 25) & SEQ_MASK == seq:
                view.cas64(at + SHARD_JOURNAL, journal, 0)

    # -- slots --------------------------------------------------------------------

    def _state(self, idx: int) -> int:
        return self._view.load64(STATES + 8 * idx)

    def _cas(self, idx: int, old: int, new: int) -> bool:
        return self._view.cas64(STATES + 8 * idx, old, new) == old

    def _slot(self, idx: int) -> int:
        return self._lay.slots + SLOT_SIZE * idx

    def _read_key(self, idx: int) -> bytes | None:
        """The slot's key bytes as they are now (torn unless the caller checks)."""
        at = self._slot(idx)
        key_len, _, block = KEY_META.unpack_from(self.mm, at)
        if not 0 < key_len <= MAX_KEY_BYTES:
            return None
        key = self.mm[at + KEY_AT : at + KEY_AT + min(key_len, INLINE_KEY)]
        if key_len > INLINE_KEY:
            if not 0 < block <= self._lay.long_blocks:
                return None
            start = self._lay.blocks + BLOCK_SIZE * (block - 1)
            key += self.mm[start : start + key_len - INLINE_KEY]
        return key

    def _read_record(self, idx: int, copy: int) -> _Record:
        return _new_record(_Record, RECORD.unpack_from(self.mm, self._slot(idx) + COPY_AT[copy]))

    def _write_record(self, idx: int, copy: int, rec: _Record) -> None:
        RECORD.pack_into(self.mm, self._slot(idx) + COPY_AT[copy], *rec)

    def _stable(self, idx: int) -> tuple[int, bytes, _Record] | None:
        """(word, key, current record) of a keyed slot, read consistently;
        None when it is not keyed, or kept changing under the reader."""
        # One call into C: the word with acquire, the key and the record the
        # word names, an acquire fence, the word again (a seqlock read that
        # holds on aarch64 too; docs/shm.md, "Memory ordering").
        lay = self._lay
        got = self._view.read_slot(
            STATES + 8 * idx,
            lay.slots + SLOT_SIZE * idx,
            KEY_AT,
            INLINE_KEY,
            lay.blocks,
            BLOCK_SIZE,
            lay.long_blocks,
            COPY_AT[0],
            RECORD.size,
            KEYED,
            READ_RETRIES,
        )
        if got is None:
            return None
        w, key, raw = got
        return w, key, _new_record(_Record, RECORD.unpack(raw))

    def _lookup(self, key: bytes, h64: int) -> tuple[int, int, _Record] | None:
        """The slot keyed to ``key``: (index, word, record), or None.

        A slot a dead process left UPDATING is rolled back on the way.
        """
        home = h64 & self._cap_mask
        while True:
            span = self._view.load32(self._lay.maxdist + 4 * home) + 1
            for idx in self._view.find_hash(
                STATES, self._lay.hashes, self.capacity, home, span, h64, KEYED
            ):
                got = self._stable(idx)
                if got is None or got[1] != key:
                    continue
                w, _, rec = got
                if w & 15 == UPDATING and not _owner_alive(w):
                    self._reclaim(idx, w)
                    break  # look again
                return idx, w, rec
            else:
                return None

    def _take(self, idx: int, w: int, sweep: bool = False) -> int | None:
        """Hold a keyed slot (UPDATING, this process); the held word, or None.
        NodeRestarted when the table is sealed (the slot as it was), unless
        for the ``sweep``, which runs on a sealed table too."""
        # _next(w, UPDATING, _copy(w), prev=w & 15, owner=owner_bits()), inlined
        own = (
            UPDATING
            | (w & 15) << 4
            | (w & 0x100)
            | owner_bits()
            | (((w >> SEQ_SHIFT) + 1) & SEQ_MASK) << SEQ_SHIFT
        )
        if self._view.cas64(STATES + 8 * idx, w, own) != w:
            return None
        if _TEST_STOP:
            _test_stop("update")
        # After the swap (a full barrier): the seal is seen, or the sealer's
        # wait_settled sees this slot held.
        if self._view.load32(SEALED) and not sweep:
            self._refuse_sealed(idx, own, w)
        return own

    def _publish(self, idx: int, own: int, code: int, copy: int) -> None:
        new = code | copy << 8 | (((own >> SEQ_SHIFT) + 1) & SEQ_MASK) << SEQ_SHIFT  # _next
        if self._view.cas64(STATES + 8 * idx, own, new) != own:
            raise SlotTakenOver(f"{self.segment.name}: slot {idx} was taken while held")

    def _rollback(self, idx: int, own: int) -> None:
        """Give back a held slot unchanged (an insert's slot becomes FREE)."""
        prev = (own >> 4) & 15
        if own & 15 == CLAIMING or prev == FREE:
            self._free_blocks_of(idx)
            prev = FREE
        self._publish(idx, own, prev, _copy(own))

    def _reclaim(self, idx: int, w: int) -> None:
        """Undo what a dead process left half done: the old record is intact."""
        if w & 15 == UPDATING:
            self._drop_journal(idx, w)
        back = FREE if w & 15 == CLAIMING else (w >> 4) & 15
        if self._cas(idx, w, _next(w, back, _copy(w))):
            _bump(self._view, RECLAIMED)

    def _update(self, idx: int, own: int, rec: _Record, code: int, count: int = 0) -> None:
        """Write the inactive copy and publish it with ``code``; with
        ``count`` (a COUNT_*), counted by the publish (the caller took its
        shard, ``_shard``, before it took the slot)."""
        copy = 1 - _copy(own)
        self._write_record(idx, copy, rec)
        if _TEST_STOP:
            _test_stop("written")
        if count:
            self._publish_counted(idx, own, code, copy, count)
        else:
            self._publish(idx, own, code, copy)
        if code == LEASED:
            _lower_expiry(self._view, rec.expires_at)

    def _publish_counted(self, idx: int, own: int, code: int, copy: int, count: int) -> None:
        new = code | copy << 8 | (((own >> SEQ_SHIFT) + 1) & SEQ_MASK) << SEQ_SHIFT  # _next
        if not self._view.publish_counted(STATES, idx, own, new, self._shard(), count, C_STOP):
            raise SlotTakenOver(f"{self.segment.name}: slot {idx} was taken while held")

    def _hold_key(self, key: bytes, h64: int) -> tuple[int, int, _Record] | Outcome:
        """Hold the key's slot, waiting out a live holder up to BUSY_WAIT_S:
        (index, held word, current record), or UNKNOWN / BUSY."""
        deadline = time.monotonic() + BUSY_WAIT_S
        while True:
            found = self._lookup(key, h64)
            if found is None:
                return Outcome.UNKNOWN
            idx, w, rec = found
            if w & 15 != UPDATING:
                own = self._take(idx, w)
                if own is not None:
                    return idx, own, rec
            if time.monotonic() > deadline:
                return Outcome.BUSY
            _pause(deadline)

    # -- long keys ------------------------------------------------------------------

    def _alloc_block(self, idx: int) -> int:
        """Index + 1 of an overflow block now owned by slot ``idx``; 0 if none is free."""
        n = self._lay.long_blocks
        start = idx % n if n else 0
        for _ in range(n):
            j = self._view.find_u64(self._lay.owners, n, start, 0)
            if j < 0:
                return 0
            if self._view.cas64(self._lay.owners + 8 * j, 0, idx + 1) == 0:
                return j + 1
            start = j + 1
        return 0

    def _free_blocks_of(self, idx: int) -> None:
        """Free every block slot ``idx`` owns (the caller holds the slot)."""
        n = self._lay.long_blocks
        while (j := self._view.find_u64(self._lay.owners, n, 0, idx + 1)) >= 0:
            self._view.cas64(self._lay.owners + 8 * j, idx + 1, 0)

    # -- grant ----------------------------------------------------------------------

    def grant(
        self,
        key: str,
        consumer: str,
        lease_s: float,
        now: float,
        cadence_s: float,
        version: int = 0,
    ) -> Lease | Refused:
        """Lease ``key`` to ``consumer`` until ``now + lease_s``, or say why not.

        ``cadence_s`` (the row's) caps the hold after a miss; ``version`` (the
        row's, as the claimer read it) is kept for the write-back of the next
        due time. An expired lease not yet swept by ``expire`` still refuses
        (LEASED). NodeRestarted when the table is sealed (and the key would
        have been granted).
        """
        if not (lease_s > 0 and cadence_s > 0):
            raise ValueError(f"lease_s {lease_s} and cadence_s {cadence_s} must be positive")
        kb = _key_bytes(key)
        holder = truncated(consumer, CONSUMER_BYTES)
        if self._granter is not None:
            got = self._granter.grant(
                kb, holder, lease_s, now, cadence_s, version, owner_bits(), C_STOP
            )
            if got.__class__ is tuple:
                lease_id, misses = got
                expires_at = now + lease_s
                return Lease(key, lease_id, consumer, now, expires_at, misses, version, cadence_s)
            if got > 0:
                return _C_REFUSED[got]
            if got == _C_NO_SHARD:  # this process's first grant: it needs a shard
                self._shard()
                return self.grant(key, consumer, lease_s, now, cadence_s, version)
            if got == _C_SEALED:
                raise NodeRestarted(
                    f"{self.segment.name} is sealed: the node that owns it stopped granting "
                    "from it; reattach to the running node's tables"
                )
            if got == _C_TAKEN_OVER:
                raise SlotTakenOver(f"{self.segment.name}: a slot was taken while held")
            # _C_SLOW: a case only the Python path knows (see shm/_claim.c)
        return self._grant_py(kb, holder, key, consumer, lease_s, now, cadence_s, version)

    def _grant_py(
        self,
        kb: bytes,
        holder: bytes,
        key: str,
        consumer: str,
        lease_s: float,
        now: float,
        cadence_s: float,
        version: int,
    ) -> Lease | Refused:
        """``grant`` in Python: every case, the C grant's slow path."""
        h64 = _hash(kb)
        self._shard()
        for _ in range(INSERT_RETRIES):
            found = self._lookup(kb, h64)
            if found is not None:
                got = self._grant_existing(found, now)
                if isinstance(got, Refused):
                    return got
                if got is None:
                    continue  # the slot changed under us: look again
                idx, own, rec = got
                lease_id = self._next_id()
                # rec._replace(lease_id=, granted_at=, expires_at=, lease_s=,
                # cadence_s=, ended=LIVE, consumer_len=, consumer=, version=),
                # built directly (_replace costs a microsecond)
                rec = _Record(
                    lease_id,
                    now,
                    now + lease_s,
                    rec.held_until,
                    lease_s,
                    cadence_s,
                    rec.misses,
                    Ended.LIVE,
                    len(holder),
                    rec.error_len,
                    holder,
                    rec.error,
                    version,
                )
                try:
                    self._update(idx, own, rec, LEASED, COUNT_GRANTS)
                except BaseException:
                    self._rollback(idx, own)
                    raise
                return Lease(
                    key, lease_id, consumer, now, now + lease_s, rec.misses, version, cadence_s
                )
            # _BLANK._replace(granted_at=, expires_at=, lease_s=, cadence_s=,
            # consumer_len=, consumer=, version=), built directly
            rec = _Record(
                0,
                now,
                now + lease_s,
                0.0,
                lease_s,
                cadence_s,
                0,
                0,
                len(holder),
                0,
                holder,
                b"",
                version,
            )
            placed = self._insert(kb, h64, rec, LEASED, fresh_id=True)
            if isinstance(placed, Refused):
                return placed
            if placed:
                return Lease(key, placed, consumer, now, now + lease_s, 0, version, cadence_s)
        return Refused(Refuse.BUSY)

    def _next_id(self) -> int:
        return self._view.add64(NEXT_LEASE_ID, 1) + 1

    def _grant_existing(
        self, found: tuple[int, int, _Record], now: float
    ) -> Refused | tuple[int, int, _Record] | None:
        idx, w, rec = found
        code = w & 15
        if code == UPDATING:
            return Refused(Refuse.BUSY)
        if code == LEASED:
            return Refused(Refuse.LEASED)
        if code == PARKED:
            return Refused(Refuse.PARKED)
        if code == HELD and rec.held_until > now:
            return Refused(Refuse.HELD)
        # IDLE, or a hold that has passed. ``rec`` was read under ``w``, and
        # the swap succeeds only if ``w`` is still there: it is still true.
        own = self._take(idx, w)
        return None if own is None else (idx, own, rec)

    def _insert(
        self, key: bytes, h64: int, rec: _Record, code: int, fresh_id: bool = False
    ) -> int | Refused:
        """Give ``key`` a slot with ``rec`` published as ``code``.

        The insert's ticket when placed (with ``fresh_id``, a grant: also the
        record's lease id, and the publish counts it); 0 when another process
        was placing the same key first (look it up again); Refused(FULL) when
        no slot (or overflow block) is free.
        """
        home = h64 & self._cap_mask
        got = self._claim_free(home)
        if got is None:
            _bump(self._view, REFUSED_FULL)
            return Refused(Refuse.FULL)
        idx, w, own = got
        copy = 1 - _copy(own)
        try:
            if not self._write_key(idx, w, key, h64):
                self._rollback(idx, own)
                _bump(self._view, REFUSED_FULL)
                return Refused(Refuse.FULL)
            if not fresh_id:  # else written once, with the ticket (below)
                self._write_record(idx, copy, rec)
            self._view.max32(self._lay.maxdist + 4 * home, (idx - home) & self._cap_mask)
            # Keyed from here on (a full barrier); then the ticket; then the probe.
            keyed = _next(own, UPDATING, _copy(own), prev=FREE, owner=owner_bits())
            if not self._cas(idx, own, keyed):
                raise SlotTakenOver(f"{self.segment.name}: slot {idx} was taken while held")
            own = keyed
            ticket = self._next_id()
            if fresh_id:
                # The inactive copy: nobody reads it before it is published.
                self._write_record(idx, copy, _new_record(_Record, (ticket, *rec[1:])))
            self._view.store64(self._slot(idx) + TICKET_AT, ticket)
            if _TEST_STOP:
                _test_stop("keyed")
            if self._placed_before(key, h64, home, idx, ticket):
                _bump(self._view, BACKOFFS)
                self._rollback(idx, own)
                return 0
            if fresh_id:
                self._publish_counted(idx, own, code, copy, COUNT_GRANTS)
            else:
                self._publish(idx, own, code, copy)
            if code == LEASED:
                _lower_expiry(self._view, rec.expires_at)
        except BaseException:
            self._rollback(idx, own)
            raise
        return ticket

    def _claim_free(self, home: int) -> tuple[int, int, int] | None:
        """Hold (CLAIMING) the first free slot from ``home``, searching the
        whole table: (index, its word before, held word), or None when full."""
        start, left = home, self.capacity
        second_pass = False
        while True:
            idx = -1
            if left > 0:
                idx = self._view.find_code(STATES, self.capacity, start, left, REUSABLE)
            if idx < 0:
                # Before refusing: take back what dead processes hold, and look
                # once more (a slot freed behind the cursor counts too).
                if second_pass:
                    return None
                self._reclaim_dead()
                second_pass, start, left = True, home, self.capacity
                continue
            w = self._state(idx)
            if (REUSABLE >> (w & 15)) & 1:
                own = _next(w, CLAIMING, _copy(w), owner=owner_bits())
                if self._cas(idx, w, own):
                    if _TEST_STOP:
                        _test_stop("insert")
                    if self._view.load32(SEALED):  # after the swap, as in _take
                        self._refuse_sealed(idx, own, w)
                    return idx, w, own
            passed = (idx - start) % self.capacity + 1
            start, left = (idx + 1) & self._cap_mask, left - passed

    def _write_key(self, idx: int, w: int, key: bytes, h64: int) -> bool:
        """Write the key into a held slot, freeing what its last key used."""
        at = self._slot(idx)
        if w & 15 == IDLE:
            block = KEY_META.unpack_from(self.mm, at)[2]
            if block:
                self._view.cas64(self._lay.owners + 8 * (block - 1), idx + 1, 0)
        elif w & 15 == FREE:
            self._free_blocks_of(idx)  # a dead or backed-off insert may have left one
        block = 0
        if len(key) > INLINE_KEY:
            block = self._alloc_block(idx)
            if not block:
                return False
            start = self._lay.blocks + BLOCK_SIZE * (block - 1)
            self.mm[start : start + len(key) - INLINE_KEY] = key[INLINE_KEY:]
        self._view.store64(self._lay.hashes + 8 * idx, h64)
        self._view.store64(at + TICKET_AT, 0)  # not drawn yet
        KEY_META.pack_into(self.mm, at, len(key), 0, block)
        head = key[:INLINE_KEY]
        self.mm[at + KEY_AT : at + KEY_AT + len(head)] = head
        return True

    def _placed_before(self, key: bytes, h64: int, home: int, mine: int, ticket: int) -> bool:
        """Whether another slot holds ``key`` ahead of this insert (so it backs off)."""
        span = self._view.load32(self._lay.maxdist + 4 * home) + 1
        for idx in self._view.find_hash(
            STATES, self._lay.hashes, self.capacity, home, span, h64, KEYED
        ):
            if idx != mine and self._ahead(idx, key, ticket):
                return True
        return False

    def _ahead(self, idx: int, key: bytes, ticket: int) -> bool:
        """Whether slot ``idx`` holds ``key`` settled, or in an insert with a
        lower ticket. Waits (up to BUSY_WAIT_S) for a racing insert to draw its
        ticket; a slot that will not hold still counts as ahead."""
        deadline = time.monotonic() + BUSY_WAIT_S
        while True:
            w = self._state(idx)
            if not (KEYED >> (w & 15)) & 1:
                return False
            same = self._read_key(idx) == key
            theirs = self._view.load64(self._slot(idx) + TICKET_AT)
            if self._view.check64(STATES + 8 * idx, w):  # an acquire fence, the word again
                if not same:
                    return False
                if w & 15 != UPDATING or (w >> 4) & 15 != FREE:
                    return True  # settled: the key is placed
                if theirs:
                    return theirs < ticket
                if not _owner_alive(w):
                    self._reclaim(idx, w)
                    return False
            if time.monotonic() > deadline:
                return True
            _pause(deadline)

    def _reclaim_dead(self) -> bool:
        """Roll back every slot a dead process holds; whether any was."""
        found = False
        for idx, w in self._view.scan_codes(STATES, self.capacity, _mask(*BUSY_CODES)):
            if not _owner_alive(w):
                self._reclaim(idx, w)
                found = True
        return found

    # -- ending leases --------------------------------------------------------------

    def complete(self, key: str, lease_id: int, now: float) -> Outcome:
        """A result for ``lease_id``: ends it and clears the key's misses,
        hold and parking. See Outcome for the answers; NodeRestarted when
        the table is sealed."""
        kb = _key_bytes(key)
        self._shard()
        held = self._hold_key(kb, _hash(kb))
        if isinstance(held, Outcome):
            return held
        idx, own, rec = held
        code = (own >> 4) & 15
        if rec.lease_id != lease_id:
            self._rollback(idx, own)
            return Outcome.SUPERSEDED if lease_id < rec.lease_id else Outcome.UNKNOWN
        if code == IDLE and rec.ended == Ended.RESULT:
            self._rollback(idx, own)
            return Outcome.REPEAT
        if code == LEASED:
            outcome, count = Outcome.COMPLETED, COUNT_COMPLETED
        elif rec.ended == Ended.RELEASED:
            outcome, count = Outcome.LATE, COUNT_LATE_RELEASED
        else:
            outcome, count = Outcome.LATE, COUNT_LATE_EXPIRED
        ended = rec._replace(misses=0, held_until=0.0, ended=Ended.RESULT)
        self._update(idx, own, ended, IDLE, count)
        return outcome

    def peek(self, key: str, lease_id: int) -> tuple[Outcome, Lease | None]:
        """What ``complete`` would answer now, changing nothing, with the
        lease's record (its version and cadence) when it would be accepted.

        The ledger asks before it makes a result durable, so that a result
        for a key granted to someone else since is refused before it is
        written; ``complete`` after the write settles it for good."""
        kb = _key_bytes(key)
        found = self._lookup(kb, _hash(kb))
        if found is None:
            return Outcome.UNKNOWN, None
        _, w, rec = found
        code = (w >> 4) & 15 if w & 15 == UPDATING else w & 15
        if rec.lease_id != lease_id:
            return (Outcome.SUPERSEDED if lease_id < rec.lease_id else Outcome.UNKNOWN), None
        if code == IDLE and rec.ended == Ended.RESULT:
            return Outcome.REPEAT, None
        lease = Lease(
            key,
            rec.lease_id,
            rec.consumer_str,
            rec.granted_at,
            rec.expires_at,
            rec.misses,
            rec.version,
            rec.cadence_s,
        )
        return (Outcome.COMPLETED if code == LEASED else Outcome.LATE), lease

    def release(self, key: str, lease_id: int, now: float, error: str | None = None) -> Outcome:
        """The holder hands the lease back without a result: a miss.

        misses + 1; held until ``now + hold_s(misses, ...)``; parked at
        max_misses. NodeRestarted when the table is sealed.
        """
        kb = _key_bytes(key)
        self._shard()
        held = self._hold_key(kb, _hash(kb))
        if isinstance(held, Outcome):
            return held
        idx, own, rec = held
        if rec.lease_id != lease_id or (own >> 4) & 15 != LEASED:
            self._rollback(idx, own)
            if rec.lease_id == lease_id:
                return Outcome.ENDED
            return Outcome.SUPERSEDED if lease_id < rec.lease_id else Outcome.UNKNOWN
        rec, code = self._missed(rec, now, Ended.RELEASED)
        message = truncated(error, ERROR_BYTES)
        self._update(
            idx, own, rec._replace(error_len=len(message), error=message), code, COUNT_RELEASED
        )
        return Outcome.RELEASED

    def _missed(self, rec: _Record, now: float, how: Ended) -> tuple[_Record, int]:
        misses = rec.misses + 1
        held_until = now + hold_s(misses, rec.lease_s, rec.cadence_s)
        code = PARKED if misses >= self.max_misses else HELD
        return rec._replace(misses=misses, held_until=held_until, ended=how), code

    def renew(self, key: str, lease_id: int, lease_s: float, now: float) -> Outcome:
        """Extend a live lease to ``now + lease_s``. A lease past its expiry is
        over (ENDED) even before the sweep has seen it. NodeRestarted when the
        table is sealed."""
        if not lease_s > 0:
            raise ValueError(f"lease_s {lease_s} must be positive")
        kb = _key_bytes(key)
        held = self._hold_key(kb, _hash(kb))
        if isinstance(held, Outcome):
            return held
        idx, own, rec = held
        if rec.lease_id != lease_id or (own >> 4) & 15 != LEASED or rec.expires_at <= now:
            self._rollback(idx, own)
            if rec.lease_id == lease_id:
                return Outcome.ENDED
            return Outcome.SUPERSEDED if lease_id < rec.lease_id else Outcome.UNKNOWN
        self._update(idx, own, rec._replace(expires_at=now + lease_s, lease_s=lease_s), LEASED)
        return Outcome.RENEWED

    def expire(self, now: float) -> list[Expired]:
        """Sweep: every lease past its expiry becomes a miss (held or parked).

        Each expiry is returned by exactly one sweep, whoever runs it: the
        state swap decides. Also rolls back slots that dead processes hold.
        Runs on a sealed table too (the keeper's sweep outlives the seal).

        The scan of the leases is skipped while ``now`` is below the table's
        next-expiry hint (EARLIEST_EXPIRY), for at most FULL_SCAN_S: a sweep
        ten times a second then reads the table about once a second while no
        lease is near its end, not every lease every time.
        """
        view = self._view
        for idx, w in view.scan_codes(STATES, self.capacity, _mask(*BUSY_CODES)):
            if not _owner_alive(w):
                self._reclaim(idx, w)
        out: list[Expired] = []
        hint = view.load64(EARLIEST_EXPIRY)
        tick = time.monotonic()
        if hint and now < _F64.unpack(_U64.pack(hint))[0] and tick < self._full_scan_due:
            return out
        self._full_scan_due = tick + FULL_SCAN_S
        # Reset, then scan: a lease published before the reset is in the scan,
        # one published after lowers the hint itself.
        view.store64(EARLIEST_EXPIRY, _INF_BITS)
        candidates, rest = self._scan_field(
            _mask(LEASED), EXPIRES_AT, now, above=False, rest_min=True
        )
        if rest != float("inf"):
            _lower_expiry(view, rest)
        if candidates:
            self._shard(sweep=True)  # before any slot is taken: each expiry is counted
        for idx, w in candidates:
            rec = self._read_record(idx, _copy(w))
            if rec.expires_at > now:
                _lower_expiry(view, rec.expires_at)  # renewed since the scan
                continue
            key = self._read_key(idx)
            own = self._take(idx, w, sweep=True)
            if own is None or key is None:  # changed since the scan: next sweep
                if own is not None:
                    self._rollback(idx, own)
                _lower_expiry(view, now)
                continue
            rec, code = self._missed(rec, now, Ended.EXPIRED)
            self._update(idx, own, rec, code, COUNT_EXPIRED)
            out.append(
                Expired(
                    key.decode(),
                    rec.lease_id,
                    rec.consumer_str,
                    rec.expires_at,
                    rec.misses,
                    rec.held_until,
                    code == PARKED,
                )
            )
        return out

    # -- clearing misses ------------------------------------------------------------

    def unhold(self, keys) -> int:
        """An operator clears the hold and parking of ``keys``; how many
        changed. NodeRestarted when the table is sealed."""
        return sum(self._clear(_key_bytes(key)) for key in keys)

    def clear_on_write(self, key: str) -> bool:
        """A new write of the row clears its misses, hold and parking.
        NodeRestarted when the table is sealed (and the key has a slot)."""
        return self._clear(_key_bytes(key))

    def _clear(self, kb: bytes) -> bool:
        h64 = _hash(kb)
        if self._lookup(kb, h64) is None:  # the common case: nothing to clear
            return False
        held = self._hold_key(kb, h64)
        if isinstance(held, Outcome):
            return False
        idx, own, rec = held
        code = (own >> 4) & 15
        if rec.misses == 0 and code not in (HELD, PARKED):
            self._rollback(idx, own)
            return False
        self._update(
            idx, own, rec._replace(misses=0, held_until=0.0), LEASED if code == LEASED else IDLE
        )
        return True

    # -- readers --------------------------------------------------------------------

    def is_excluded(self, key: str, now: float) -> bool:
        """Whether the keeper should leave ``key`` out of the ready set."""
        kb = _key_bytes(key)
        found = self._lookup(kb, _hash(kb))
        if found is None:
            return False
        _, w, rec = found
        return _excluded(w, rec, now)

    def excluded_keys(self, now: float) -> set[str]:
        """Every key that is leased, held (until after ``now``), parked or mid-change.

        One pass in C reads and decodes the keys (each slot between two reads
        of its word); the few slots that kept changing under it are settled
        here, as ``_stable`` reads them. The keys' str objects are kept for
        the next call, which gives again those whose slot bytes are the same
        (no decoding, hashes already computed): the keeper calls it before
        every publish, and most excluded keys stay excluded between two."""
        if self._key_cache is None:
            self._key_cache = [None] * self.capacity
        keys, unsettled = self._view.excluded_keys(*self._scan_layout(now), self._key_cache)
        for idx in unsettled:
            got = self._stable(idx)
            if got is not None and _excluded(got[0], got[2], now):
                keys.add(got[1].decode())
        return keys

    def excluded_changes(
        self, now: float, hints: Sequence[tuple[Any, list[str], int, int]] = ()
    ) -> tuple[list[str], list[str]]:
        """The keys that became excluded since the last call, and those that
        no longer are: ``(added, removed)``; the first call gives every
        excluded key as added. For the keeper, which keeps the excluded keys
        out of its orders and so needs only what changed: one pass in C that
        passes over each slot whose word made no transition since it was
        last read (a word's seq moves with every transition), so the cost
        follows the slots that changed, not the keys excluded.

        The keys are followed by how many slots hold each out (``excluded``):
        a key is added when its first slot takes it and removed when its
        last lets it go, so a key that moved to another slot, or was keyed in
        two for a moment (two inserts of it racing: one backs off and frees
        its slot), is in neither list. A key can be in both when it left
        and came back within one call: apply ``removed`` before ``added``.

        ``hints``: up to four ``(records, keys, n, tag)``, the grant records
        claimers wrote for a set the keeper published (``ReadySet.grant_records``
        with that set's keys): a slot whose lease word is still the one a
        record names is settled with the keeper's own str for it, unread
        (the records' layout is in shm/ready.py). Only a shortcut: what a
        record cannot vouch for is read as before. After the call, the first
        ``hinted_added`` keys of ``added`` are strs of the hints' key lists.

        Shares its per-slot cache with ``excluded_keys``: call one or the
        other on a table, not both."""
        if self._key_cache is None:
            self._key_cache = [None] * self.capacity
            self._key_slots.clear()
            self._key_extra.clear()
        if self._seen is None:
            self._seen = bytearray(b"\xff" * (8 * self.capacity))
        slots, extra = self._key_slots, self._key_extra
        full = tuple((records, keys, n, tag, LEASED, SEQ_SHIFT) for records, keys, n, tag in hints)
        added, removed, unsettled, self.hinted_added = self._view.excluded_keys(
            *self._scan_layout(now), self._key_cache, self._seen, (slots, extra), full or None
        )
        cache = self._key_cache
        for idx in unsettled:  # kept changing under the scan: settled here
            got = self._stable(idx)
            new = got[1].decode() if got is not None and _excluded(got[0], got[2], now) else None
            old = cache[idx]
            if old == new:
                continue
            cache[idx] = new
            if old is not None:
                more = extra.pop(old, 0)
                if more > 1:
                    extra[old] = more - 1
                elif not more:
                    slots.discard(old)
                    removed.append(old)
            if new is not None:
                if new in slots:
                    extra[new] = extra.get(new, 0) + 1
                else:
                    slots.add(new)
                    added.append(new)
        return added, removed

    @property
    def excluded(self) -> AbstractSet[str]:
        """What ``excluded_changes`` has reported so far and not taken back:
        the keys held out. Kept in place, so a reference to it stays current.
        (A set, not a mapping of counts: a set's entries hold their keys'
        hashes, so a miss costs one cache line, where a big dict's costs
        three; the keeper adds every key granted to it.)"""
        return self._key_slots

    def excluded_slots(self, key: str) -> int:
        """How many slots hold ``key`` out, as ``excluded_changes`` counts
        them: 0 when it is not excluded, 1 but for a moment."""
        return 1 + self._key_extra.get(key, 0) if key in self._key_slots else 0

    def _scan_layout(self, now: float) -> tuple:
        """The C scan's arguments before its cache: where slots, keys, holds
        and overflow blocks lie, ``now``, which codes are excluded."""
        return (
            STATES,
            self.capacity,
            self._lay.slots,
            SLOT_SIZE,
            KEY_AT,
            INLINE_KEY,
            COPY_AT[0] + HELD_UNTIL,
            COPY_AT[1] + HELD_UNTIL,
            self._lay.blocks,
            BLOCK_SIZE,
            self._lay.long_blocks,
            now,
            _mask(UPDATING, LEASED, PARKED),
            _mask(HELD),
            SCAN_RETRIES,
        )

    def forget_changes(self) -> None:
        """Make the next ``excluded_changes`` report every excluded key as
        added (a new follower, such as a keeper starting over)."""
        self._key_cache = None
        self._seen = None
        self._key_slots.clear()
        self._key_extra.clear()

    def _excluded_keys_py(self, now: float) -> set[str]:
        """``excluded_keys`` in Python, slot by slot (the tests compare the two)."""
        out = set()
        candidates = self._view.scan_codes(STATES, self.capacity, _mask(UPDATING, LEASED, PARKED))
        candidates += self._scan_field(_mask(HELD), HELD_UNTIL, now, above=True)
        for idx, w in candidates:
            key = self._read_key(idx)
            if key is None or not self._view.check64(STATES + 8 * idx, w):  # changed since
                got = self._stable(idx)
                if got is None or not _excluded(got[0], got[2], now):
                    continue
                key = got[1]
            out.add(key.decode())
        return out

    def _scan_field(
        self, codes: int, field: int, limit: float, above: bool, rest_min: bool = False
    ) -> Any:
        """(index, word) of the slots in ``codes`` whose current record's f64
        at ``field`` is above (or at most) ``limit``; one pass in C. With
        ``rest_min``, ``(those, the least field of the others in codes)``."""
        return self._view.scan_f64(
            STATES,
            self.capacity,
            codes,
            self._lay.slots,
            SLOT_SIZE,
            COPY_AT[0] + field,
            COPY_AT[1] + field,
            limit,
            above,
            rest_min,
        )

    def live(self, limit: int = 1000) -> list[Lease]:
        """Live leases (expired ones not yet swept included), oldest grant first."""
        out = []
        for _code, key, rec in self._scan(_mask(LEASED)):
            out.append(
                Lease(
                    key.decode(),
                    rec.lease_id,
                    rec.consumer_str,
                    rec.granted_at,
                    rec.expires_at,
                    rec.misses,
                )
            )
        out.sort(key=lambda lease: lease.granted_at)
        return out[:limit]

    def held(self, limit: int = 1000) -> list[Hold]:
        """Keys with misses that are not leased: held (even if the hold has
        passed) and parked, parked first, then by held_until."""
        out = []
        for code, key, rec in self._scan(_mask(HELD, PARKED)):
            out.append(
                Hold(
                    key.decode(),
                    rec.lease_id,
                    rec.misses,
                    rec.held_until,
                    code == PARKED,
                    rec.error_str,
                )
            )
        out.sort(key=lambda hold: (not hold.parked, hold.held_until))
        return out[:limit]

    def _scan(self, codes: int):
        """(code, key, record) of the slots whose code is in ``codes``. A slot
        held mid-change counts as what it was: its record is still current."""
        for idx, _ in self._view.scan_codes(STATES, self.capacity, codes | _mask(UPDATING)):
            got = self._stable(idx)
            if got is None:
                continue
            w, key, rec = got
            code = (w >> 4) & 15 if w & 15 == UPDATING else w & 15
            if (codes >> code) & 1:
                yield code, key, rec

    def stats(self) -> dict[str, Any]:
        counts = dict.fromkeys(CODE_NAMES, 0)
        with memoryview(self.mm)[STATES : STATES + 8 * self.capacity] as raw:
            with raw.cast("Q") as words:
                for w in words.tolist():
                    counts[CODE_NAMES[w & 15]] += 1
            with memoryview(self.mm)[self._lay.maxdist : self._lay.owners] as md:
                with md.cast("I") as dists:
                    max_probe = max(dists.tolist()) + 1
            with memoryview(self.mm)[self._lay.owners : self._lay.slots] as ow:
                with ow.cast("Q") as owners:
                    blocks_used = sum(1 for o in owners.tolist()[: self._lay.long_blocks] if o)
        view = self._view
        return {
            "capacity": self.capacity,
            "slots": counts,
            "long_blocks": self._lay.long_blocks,
            "long_blocks_used": blocks_used,
            "max_probe": max_probe,
            "max_misses": self.max_misses,
            "next_lease_id": view.load64(NEXT_LEASE_ID) + 1,
            "reclaimed": view.load64(RECLAIMED),
            "backoffs": view.load64(BACKOFFS),
            "shards": view.load32(self._lay.shards),
            "sealed": self.sealed,
            **self.counters(),
        }

    def counters(self) -> dict[str, int]:
        """The lifetime counters this table keeps (see COUNTERS): the
        header's base plus every counter shard, after counting what a dead
        process published and did not count (``_settle``)."""
        view = self._view
        first, used = self._lay.shards + SHARDS_HEADER, view.load32(self._lay.shards)
        sums, pending = view.shard_counts(first, used)
        settled = False
        for i in pending:  # a publish in progress, or one a dead process left
            at = first + SHARD_SIZE * i
            owner = view.load64(at)
            if owner and not _owner_alive(owner):
                self._settle(at, owner)
                settled = True
        if settled:
            sums, _ = view.shard_counts(first, used)
        out = {
            name: view.load64(COUNTERS[name]) + n
            for name, n in zip(SHARD_COUNTS, sums, strict=True)
        }
        out["refused_full"] = view.load64(REFUSED_FULL)
        return out

    def live_count(self) -> int:
        """Leases live now (expired ones not yet swept included): in flight."""
        return len(self._view.scan_codes(STATES, self.capacity, _mask(LEASED)))

    def code_counts(self) -> dict[str, int]:
        """Slots per state (CODE_NAMES), in one pass in C over the state words
        and nothing else: what ``GET /queue-state`` asks at every call
        (``leased`` = in flight, ``held``, ``parked``; one key, one slot, so
        these are distinct keys). A slot held mid-change counts as the state
        it was in, as ``_scan`` reads it; ``claiming`` is a slot getting a
        new key, not yet leased."""
        counts = self._view.code_counts(STATES, self.capacity, UPDATING)
        return {name: counts[code] for code, name in enumerate(CODE_NAMES)}

    # -- a clean shutdown and the next start -----------------------------------------

    def save(self, path: str | os.PathLike[str], now: float) -> int:
        """Write the leased, held and parked keys to ``path`` (msgpack),
        atomically; how many. The supervisor calls it after the workers stop."""
        entries = [
            [key, code, *rec[:8], rec.consumer_str, rec.error_str, rec.version]
            for code, key, rec in self._scan(_mask(LEASED, HELD, PARKED))
        ]
        doc = {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "saved_at": now,
            "next_lease_id": self._view.load64(NEXT_LEASE_ID),
            "counters": self.counters(),
            "entries": entries,
        }
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        # Owner-only whatever the umask (the keys are the users' data).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgpack.packb(doc, use_bin_type=True))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return len(entries)

    def load(self, path: str | os.PathLike[str]) -> int:
        """Put back what ``save`` wrote; how many entries were placed.

        A key the table already has keeps what the table says (shared memory
        is the newer evidence). Lease ids continue after the saved ones. A
        file that is not a lease file of this version is a NodeError naming it.
        """
        saved_next, counters, entries = _read_lease_file(Path(path))
        # Lifetime counters continue from the saved ones, unless this table
        # already counts (it was reattached: shared memory is newer evidence).
        if not any(self.counters().values()):
            for name, value in counters.items():
                if name in COUNTERS:
                    self._view.store64(COUNTERS[name], int(value))
        current = self._view.load64(NEXT_LEASE_ID)
        while current < saved_next:
            seen = self._view.cas64(NEXT_LEASE_ID, current, saved_next)
            current = saved_next if seen == current else seen
        placed = 0
        for key, code, rec in entries:
            h64 = _hash(key)
            for _ in range(INSERT_RETRIES):
                if self._lookup(key, h64) is not None:
                    break
                done = self._insert(key, h64, rec, code)
                if isinstance(done, Refused):
                    break
                if done:
                    placed += 1
                    break
        return placed


def _read_lease_file(path: Path) -> tuple[int, dict, list[tuple[bytes, int, _Record]]]:
    try:
        doc = msgpack.unpackb(path.read_bytes(), raw=False)
        if doc.get("format") != FILE_FORMAT or doc.get("version") != FILE_VERSION:
            raise ValueError(
                f"format {doc.get('format')!r} version {doc.get('version')!r}, "
                f"expected {FILE_FORMAT!r} version {FILE_VERSION}"
            )
        entries = []
        for key, code, *fields, consumer, error, version in doc["entries"]:
            if code not in (LEASED, HELD, PARKED) or len(fields) != 8:
                raise ValueError(f"entry for {key!r}: state {code}, {len(fields)} fields")
            _key_bytes(key.decode())
            holder = truncated(consumer, CONSUMER_BYTES)
            message = truncated(error, ERROR_BYTES)
            rec = _Record._make([*fields, len(holder), len(message), holder, message, version])
            entries.append((bytes(key), code, rec))
        return int(doc["next_lease_id"]), dict(doc.get("counters") or {}), entries
    except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as exc:
        raise NodeError(f"{path} is not a lease file this node can load: {exc}") from exc


def _excluded(w: int, rec: _Record, now: float) -> bool:
    code = w & 15
    if code == HELD:
        return rec.held_until > now
    return code != IDLE


if _claim is not None:  # the C grant's offsets are these (shm/_claim.c, LEASE_LAYOUT)
    segment.check_layout(
        "shm._claim",
        _claim.LEASE_LAYOUT,
        {**globals(), "RECORD_SIZE": RECORD.size, "COPY_AT_0": COPY_AT[0], "COPY_AT_1": COPY_AT[1]},
    )
