"""``LeaseTable``: the lease table's public API, on the bases that hold the
protocol (slots.py), the grant (grant.py) and the keeper's scans (scan.py).

Here: the lifecycle (the supervisor creates, seals, saves and unlinks;
every other process attaches and closes), the changes a caller asks for
besides a grant (complete, release, renew, unhold; a group's completions in
one call, ``complete_many``), and the readers (``lookup``, ``peek``,
``peek_many``, ``live``, ``held``, ``stats``, ``counters``). How the
table works: shm/leases/__init__.py.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from node.core.errors import NodeError
from node.core.names import shm_segment_name
from shm import segment
from shm.leases.answers import Hold, Lease, Outcome, Refused
from shm.leases.grant import _C_NO_SHARD, _C_SEALED, _C_SLOW, _C_TAKEN_OVER, Grants
from shm.leases.persist import read_lease_file, write_lease_file
from shm.leases.policy import missed
from shm.leases.protocol import (
    BACKOFFS,
    BUSY_CODES,
    CODE_NAMES,
    COUNT_COMPLETED,
    COUNT_LATE_EXPIRED,
    COUNT_LATE_RELEASED,
    COUNT_RELEASED,
    COUNTERS,
    DEFAULT_CAPACITY,
    DEFAULT_MAX_MISSES,
    ERROR_BYTES,
    HELD,
    IDLE,
    INSERT_RETRIES,
    KIND,
    LAYOUT_VERSION,
    LEASED,
    MAX_CAPACITY,
    NEXT_LEASE_ID,
    PARKED,
    RECLAIMED,
    REFUSED_FULL,
    SEALED,
    SETTLE_POLL_S,
    SHARD_COUNTS,
    SHARD_SIZE,
    SHARDS_HEADER,
    STATES,
    TABLE_FIELDS,
    TABLE_FIELDS_OFFSET,
    UPDATING,
    Ended,
    SlotTakenOver,
    _hash,
    _key_bytes,
    _mask,
    _owner_alive,
    _Record,
    _require_atomics,
    owner_bits,
    segment_size_for,
    truncated,
)
from shm.leases.scan import Scans
from shm.leases.test_stops import C_STOP

# What Granter.complete_many and peek_many answer, by index (shm/_complete.c A_*).
_ANSWERS = (Outcome.COMPLETED, Outcome.LATE, Outcome.REPEAT, Outcome.SUPERSEDED, Outcome.UNKNOWN)


class LeaseTable(Grants, Scans):
    """The node's lease table, mapped (``create`` or ``attach``)."""

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
        name = shm_segment_name(node, KIND)
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
        table = cls(segment.attach(shm_segment_name(node, KIND), LAYOUT_VERSION))
        segment.populate(table.segment.mm)
        return table

    @staticmethod
    def unlink(node: str) -> bool:
        """Supervisor only, after ``save``."""
        return segment.unlink(shm_segment_name(node, KIND))

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

    # -- the seal (the supervisor, at a clean shutdown) ---------------------------

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

    # -- for the C claim path and the claimer's explain ----------------------------

    @property
    def granter(self) -> Any:
        """The C grant on this mapping (``shm._claim.Granter``), which a C
        claim path (workers/claim/path.py) is built on; None without shm._claim."""
        return self._granter

    def lookup(self, key: str) -> tuple[str, _Record] | None:
        """(state name, current record) of ``key``'s slot, or None when the
        table has none. The name is one of CODE_NAMES; a slot held
        mid-change counts as what it was (its current record still stands).
        A slot a dead process left mid-change is rolled back on the way."""
        kb = _key_bytes(key)
        found = self._lookup(kb, _hash(kb))
        if found is None:
            return None
        _idx, w, rec = found
        code = (w >> 4) & 15 if w & 15 == UPDATING else w & 15
        return CODE_NAMES[code], rec

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

    def complete_many(self, items: Iterable[tuple[str, int]], now: float) -> list[Outcome]:
        """``complete`` for each (key, lease id) of ``items``, in order: the
        outcomes. The C path (shm/_complete.c) does a group in one call, the
        same protocol step for step; an item it leaves to Python (a slot held
        mid-change, a long key, ...) is ``complete``'s, and the rest goes on
        in C, so a group has exactly the effects of the loop, a raise
        (NodeRestarted when sealed) included: the items before it are done."""
        items = items if items.__class__ is list else list(items)
        g = self._granter
        if g is None:
            return [self.complete(key, lease_id, now) for key, lease_id in items]
        out: list[Outcome] = []
        i, n = 0, len(items)
        while i < n:
            done, why = g.complete_many(items, i, owner_bits(), C_STOP, _ANSWERS)
            out += done
            i += len(done)
            if why == _C_SLOW:
                key, lease_id = items[i]
                out.append(self.complete(key, lease_id, now))
                i += 1
            elif why == _C_NO_SHARD:  # this process's first change: it takes a shard
                self._shard()
                g.set_shard(self._shard_at, owner_bits())
            elif why == _C_SEALED:
                self._refuse_sealed(-1, 0, 0)
            elif why == _C_TAKEN_OVER:
                raise SlotTakenOver(f"{self.segment.name}: a slot was taken while held")
        return out

    def peek_many(self, items: Iterable[tuple[str, int]]) -> list[tuple[Outcome, Lease | None]]:
        """``peek`` for each (key, lease id) of ``items``: what ``complete``
        would answer now, changing nothing. In C a group at a time, as
        ``complete_many``."""
        items = items if items.__class__ is list else list(items)
        g = self._granter
        if g is None:
            return [self.peek(key, lease_id) for key, lease_id in items]
        out: list[tuple[Outcome, Lease | None]] = []
        i, n = 0, len(items)
        while i < n:
            done, _why = g.peek_many(items, i, Lease, _ANSWERS)
            out += done
            i += len(done)
            if i < n:  # _C_SLOW: a slot held mid-change, a long key, ...
                key, lease_id = items[i]
                out.append(self.peek(key, lease_id))
                i += 1
        return out

    def pin_late(self, key: str, lease_id: int, until: float) -> bool:
        """Keep ``key`` from being granted again until ``until``, for a late
        result of ``lease_id`` (its lease expired or was released, and the
        key not granted since) that the ledger is making durable: the
        result's ``complete`` after the write then finds that same lease
        and ends it (LATE), where a grant in between would leave the result
        durable with its lease counted expired too (docs/delivery.md). The
        slot is held until ``until`` (a longer hold is kept); ``complete``
        clears it. True when pinned; False when the slot no longer holds
        that ended lease, or is parked (never granted by itself)."""
        kb = _key_bytes(key)
        held = self._hold_key(kb, _hash(kb))
        if isinstance(held, Outcome):
            return False
        idx, own, rec = held
        code = (own >> 4) & 15
        if (
            rec.lease_id != lease_id
            or code not in (HELD, IDLE)
            or rec.ended == Ended.RESULT
            or (code == HELD and rec.held_until >= until)
        ):
            self._rollback(idx, own)
            return code == HELD and rec.lease_id == lease_id and rec.held_until >= until
        self._update(idx, own, rec._replace(held_until=until), HELD)
        return True

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
        rec, code = missed(rec, now, Ended.RELEASED, self.max_misses)
        message = truncated(error, ERROR_BYTES)
        self._update(
            idx, own, rec._replace(error_len=len(message), error=message), code, COUNT_RELEASED
        )
        return Outcome.RELEASED

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
            "saved_at": now,
            "next_lease_id": self._view.load64(NEXT_LEASE_ID),
            "counters": self.counters(),
            "entries": entries,
        }
        write_lease_file(Path(path), doc)
        return len(entries)

    def load(self, path: str | os.PathLike[str]) -> int:
        """Put back what ``save`` wrote; how many entries were placed.

        A key the table already has keeps what the table says (shared memory
        is the newer evidence). Lease ids continue after the saved ones. A
        file that is not a lease file of this version is a NodeError naming it.
        """
        saved_next, counters, entries = read_lease_file(Path(path))
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
