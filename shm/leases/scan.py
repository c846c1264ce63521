"""The keeper's scans: ``Scans``, a base of ``LeaseTable`` (table.py).

``expire``, the sweep that turns every lease past its expiry into a miss
(skipped while the next-expiry hint says none is due), and the reads of the
keys the keeper leaves out of the ready set: ``excluded_keys`` (all of
them) and ``excluded_changes`` (what changed since the last call), each one
pass in C over the state words (shm/_atomic.c), with a per-slot cache of the
keys' str objects so that a key excluded at two calls is decoded once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from shm.leases.answers import Expired
from shm.leases.policy import excludes, missed
from shm.leases.protocol import (
    _F64,
    _INF_BITS,
    _U64,
    BLOCK_SIZE,
    BUSY_CODES,
    COPY_AT,
    COUNT_EXPIRED,
    EARLIEST_EXPIRY,
    EXPIRES_AT,
    FULL_SCAN_S,
    HELD,
    HELD_UNTIL,
    INLINE_KEY,
    KEY_AT,
    LEASED,
    PARKED,
    SCAN_RETRIES,
    SEQ_SHIFT,
    SLOT_SIZE,
    STATES,
    UPDATING,
    Ended,
    _copy,
    _hash,
    _key_bytes,
    _lower_expiry,
    _mask,
    _owner_alive,
)
from shm.leases.slots import SlotTable


class Scans(SlotTable):
    """The sweep and the excluded keys."""

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
            rec, code = missed(rec, now, Ended.EXPIRED, self.max_misses)
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

    def is_excluded(self, key: str, now: float) -> bool:
        """Whether the keeper should leave ``key`` out of the ready set."""
        kb = _key_bytes(key)
        found = self._lookup(kb, _hash(kb))
        if found is None:
            return False
        _, w, rec = found
        return excludes(w, rec, now)

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
            if got is not None and excludes(got[0], got[2], now):
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
        (the records' layout is in shm/ready/). Only a shortcut: what a
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
            new = got[1].decode() if got is not None and excludes(got[0], got[2], now) else None
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
                if got is None or not excludes(got[0], got[2], now):
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
