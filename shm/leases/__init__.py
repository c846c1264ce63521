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

The package, by concern (read in this order):

    protocol.py    the layout (every offset, code and struct), the state word,
                   the record, who holds a slot (pid and start-time tag)
    answers.py     what the table answers: Lease, Refused, Outcome, Expired, Hold
    slots.py       SlotTable: the mapping and the protocol's primitives (read a
                   slot, find a key, take, publish, roll back, reclaim), the seal's
                   refusal, the counter shards and their journal (settle)
    grant.py       Grants: the grant in Python (the C grant's slow path), the
                   insert of a new key, free-slot claim, key writing, long keys
    scan.py        Scans: the sweep (expire) and the keeper's excluded keys
    policy.py      the hold policy: hold_s, what a miss does, what is excluded
    persist.py     the lease file a clean shutdown saves and the next start loads
    table.py       LeaseTable(Grants, Scans): create, attach, seal, wait_settled,
                   close, and the public API
    test_stops.py  tests only: the stop points and the test build of the extensions

The C side (the grant and the whole claim in shm/_claim.c, the atomics and
scans in shm/_atomic.c) uses the same layout; the offsets it was built with
are checked against protocol.py's at import (below).
"""

from __future__ import annotations

from shm import layout
from shm.leases import protocol
from shm.leases.answers import Expired, Hold, Lease, Outcome, Refuse, Refused
from shm.leases.persist import FILE_FORMAT, FILE_VERSION
from shm.leases.policy import hold_s
from shm.leases.protocol import (
    BACKOFFS,
    BLOCK_SIZE,
    BUSY_WAIT_S,
    CLAIMING,
    CODE_NAMES,
    CONSUMER_BYTES,
    COPY_AT,
    COUNTERS,
    DEFAULT_CAPACITY,
    DEFAULT_MAX_MISSES,
    EARLIEST_EXPIRY,
    EMPTY,
    ERROR_BYTES,
    FREE,
    FULL_SCAN_S,
    HELD,
    IDLE,
    INLINE_KEY,
    KEY_AT,
    KEY_META,
    KEYED,
    KIND,
    LAYOUT_VERSION,
    LEASED,
    MAX_CAPACITY,
    MAX_KEY_BYTES,
    NEXT_LEASE_ID,
    PARKED,
    READ_RETRIES,
    RECORD,
    SEALED,
    SEQ_MASK,
    SEQ_SHIFT,
    SHARD_JOURNAL,
    SLOT_SIZE,
    STATES,
    TAG_MASK,
    TICKET_AT,
    UPDATING,
    AtomicsMissing,
    Ended,
    SlotTakenOver,
    _copy,
    _hash,
    _key_bytes,
    _mask,
    _next,
    _Record,
    owner_bits,
    segment_size_for,
    truncated,
)
from shm.leases.table import LeaseTable
from shm.leases.test_stops import C_STOP

__all__ = [
    "AtomicsMissing",
    "BACKOFFS",
    "BLOCK_SIZE",
    "BUSY_WAIT_S",
    "C_STOP",
    "CLAIMING",
    "CODE_NAMES",
    "CONSUMER_BYTES",
    "COPY_AT",
    "COUNTERS",
    "DEFAULT_CAPACITY",
    "DEFAULT_MAX_MISSES",
    "EARLIEST_EXPIRY",
    "EMPTY",
    "ERROR_BYTES",
    "Ended",
    "Expired",
    "FILE_FORMAT",
    "FILE_VERSION",
    "FREE",
    "FULL_SCAN_S",
    "HELD",
    "Hold",
    "IDLE",
    "INLINE_KEY",
    "KEY_AT",
    "KEY_META",
    "KEYED",
    "KIND",
    "LAYOUT_VERSION",
    "LEASED",
    "Lease",
    "LeaseTable",
    "MAX_CAPACITY",
    "MAX_KEY_BYTES",
    "NEXT_LEASE_ID",
    "Outcome",
    "PARKED",
    "READ_RETRIES",
    "RECORD",
    "Refuse",
    "Refused",
    "SEALED",
    "SEQ_MASK",
    "SEQ_SHIFT",
    "SHARD_JOURNAL",
    "SLOT_SIZE",
    "STATES",
    "SlotTakenOver",
    "TAG_MASK",
    "TICKET_AT",
    "UPDATING",
    # private, for the tests (and workers/claim/path.py's explain) that reach in
    "_Record",
    "_copy",
    "_hash",
    "_key_bytes",
    "_mask",
    "_next",
    "hold_s",
    "owner_bits",
    "segment_size_for",
    "truncated",
]

# Every built C module's lease-table offsets are these (shm/layout.h, checked
# by shm/layout.py): a build of another layout fails here, at import.
layout.check_leases(vars(protocol))
