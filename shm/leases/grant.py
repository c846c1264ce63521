"""Granting: ``Grants``, the lease table's grant path in Python, a base of
``LeaseTable`` (table.py). ``grant`` takes the C grant (shm/_claim.c) when
it is built, which handles the common cases with the same protocol, and
falls back here for the rest: an insert of a new key (a free slot claimed
anywhere in the table, its key written, the race with other inserts of the
same key settled by tickets), long keys' overflow blocks, and what the C
path leaves to Python (``_C_SLOW``). Why each step: shm/leases/__init__.py.
"""

from __future__ import annotations

import time

from node.core.errors import NodeRestarted
from shm.leases import test_stops
from shm.leases.answers import Lease, Refuse, Refused
from shm.leases.protocol import (
    BACKOFFS,
    BLOCK_SIZE,
    BUSY_CODES,
    BUSY_WAIT_S,
    CLAIMING,
    CONSUMER_BYTES,
    COUNT_GRANTS,
    FREE,
    HELD,
    IDLE,
    INLINE_KEY,
    INSERT_RETRIES,
    KEY_AT,
    KEY_META,
    KEYED,
    LEASED,
    NEXT_LEASE_ID,
    PARKED,
    REFUSED_FULL,
    REUSABLE,
    SEALED,
    STATES,
    TICKET_AT,
    UPDATING,
    Ended,
    SlotTakenOver,
    _bump,
    _copy,
    _hash,
    _key_bytes,
    _lower_expiry,
    _mask,
    _new_record,
    _next,
    _owner_alive,
    _pause,
    _Record,
    owner_bits,
    truncated,
)
from shm.leases.slots import SlotTable
from shm.leases.test_stops import C_STOP, Stop

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


class Grants(SlotTable):
    """The grant and the insert of a new key."""

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
        self,
        key: bytes,
        h64: int,
        rec: _Record,
        code: int,
        fresh_id: bool = False,
        stop: Stop | None = test_stops.stop,
    ) -> int | Refused:
        """Give ``key`` a slot with ``rec`` published as ``code``.

        The insert's ticket when placed (with ``fresh_id``, a grant: also the
        record's lease id, and the publish counts it); 0 when another process
        was placing the same key first (look it up again); Refused(FULL) when
        no slot (or overflow block) is free. (``stop``: a test's,
        test_stops.py; None in production.)
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
            if stop is not None:
                stop("keyed")
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

    def _claim_free(
        self, home: int, stop: Stop | None = test_stops.stop
    ) -> tuple[int, int, int] | None:
        """Hold (CLAIMING) the first free slot from ``home``, searching the
        whole table: (index, its word before, held word), or None when full.
        (``stop``: as ``_insert``'s.)"""
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
                    if stop is not None:
                        stop("insert")
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
