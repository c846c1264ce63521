"""The lease table's slots and counter shards: ``SlotTable``, the base of
``LeaseTable`` (table.py), holding the mapping and the protocol's
primitives: read a slot consistently, find a key's slot, take a slot with a
compare-and-swap, publish (counted or not), roll back, take back what a dead
process left, and settle what a dead process published and did not count.
The grant (grant.py), the sweep and the keeper's scans (scan.py) and the
public API (table.py) are built on these. Why each step: shm/leases/__init__.py
and docs/leases.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from node.core.errors import NodeError, NodeRestarted
from shm.leases import test_stops
from shm.leases.answers import Outcome
from shm.leases.protocol import (
    _SLOT_MASK,
    _TARGET_MASK,
    BLOCK_SIZE,
    BUSY_WAIT_S,
    CLAIMING,
    COPY_AT,
    FREE,
    INLINE_KEY,
    KEY_AT,
    KEY_META,
    KEYED,
    LEASED,
    MAX_KEY_BYTES,
    MAX_SHARDS,
    OWNER_MASK,
    READ_RETRIES,
    RECLAIMED,
    RECORD,
    SEALED,
    SEQ_MASK,
    SEQ_SHIFT,
    SHARD_JOURNAL,
    SHARD_SIZE,
    SHARDS_HEADER,
    SLOT_SIZE,
    STATES,
    TABLE_FIELDS,
    TABLE_FIELDS_OFFSET,
    UPDATING,
    SlotTakenOver,
    _atomic,
    _bump,
    _claim,
    _copy,
    _layout,
    _lower_expiry,
    _mask,
    _new_record,
    _next,
    _owner_alive,
    _pause,
    _Record,
    owner_bits,
)
from shm.leases.test_stops import C_STOP, Stop
from shm.segment import Segment


class SlotTable:
    """A lease table's mapping and the protocol's primitives on it."""

    def __init__(self, seg: Segment) -> None:
        self.segment = seg
        self.mm = seg.mm
        self._view = _atomic.View(seg.mm)
        capacity, long_blocks, _ = TABLE_FIELDS.unpack_from(seg.mm, TABLE_FIELDS_OFFSET)
        self._lay = _layout(capacity, long_blocks)
        self.capacity = capacity
        self._cap_mask = capacity - 1
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
        # The keeper's scans (scan.py). The str of each excluded slot's key
        # from the last excluded_keys call (the keeper's), made at its first
        # call; the C scan owns it and compares each str with the slot's
        # bytes before it gives it again.
        self._key_cache: list[str | None] | None = None
        self._seen: bytearray | None = None  # excluded_changes: each slot's last word
        #: after excluded_changes: how many of its added keys came first from the hints
        self.hinted_added = 0
        # excluded_changes: the keys some slot's cache item holds, and for the
        # few held by more than one slot (for a moment), how many more.
        self._key_slots: set[str] = set()
        self._key_extra: dict[str, int] = {}
        self._full_scan_due = 0.0  # expire: scan at this monotonic time whatever the hint

    def __repr__(self) -> str:
        return f"<LeaseTable {self.segment.name} {self.capacity} slots>"

    @property
    def max_misses(self) -> int:
        return TABLE_FIELDS.unpack_from(self.mm, TABLE_FIELDS_OFFSET)[2]

    @property
    def sealed(self) -> bool:
        return bool(self._view.load32(SEALED))

    # -- the seal -----------------------------------------------------------------

    def _refuse_sealed(self, idx: int, own: int, w: int) -> None:
        """The table is sealed: put back the word a change found in slot
        ``idx`` (it wrote nothing yet; -1: it holds none) and say so."""
        if idx >= 0 and self._view.cas64(STATES + 8 * idx, own, w) != own:
            raise SlotTakenOver(f"{self.segment.name}: slot {idx} was taken while held")
        raise NodeRestarted(
            f"{self.segment.name} is sealed: the node that owns it stopped granting from "
            "it; reattach to the running node's tables"
        )

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

    def _take(
        self, idx: int, w: int, sweep: bool = False, stop: Stop | None = test_stops.stop
    ) -> int | None:
        """Hold a keyed slot (UPDATING, this process); the held word, or None.
        NodeRestarted when the table is sealed (the slot as it was), unless
        for the ``sweep``, which runs on a sealed table too. (``stop``: a
        test's, test_stops.py; None in production.)"""
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
        if stop is not None:
            stop("update")
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

    def _update(
        self,
        idx: int,
        own: int,
        rec: _Record,
        code: int,
        count: int = 0,
        stop: Stop | None = test_stops.stop,
    ) -> None:
        """Write the inactive copy and publish it with ``code``; with
        ``count`` (a COUNT_*), counted by the publish (the caller took its
        shard, ``_shard``, before it took the slot). (``stop``: as ``_take``'s.)"""
        copy = 1 - _copy(own)
        self._write_record(idx, copy, rec)
        if stop is not None:
            stop("written")
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

    def _free_blocks_of(self, idx: int) -> None:
        """Free every block slot ``idx`` owns (the caller holds the slot)."""
        n = self._lay.long_blocks
        while (j := self._view.find_u64(self._lay.owners, n, 0, idx + 1)) >= 0:
            self._view.cas64(self._lay.owners + 8 * j, idx + 1, 0)

    # -- reading many slots ---------------------------------------------------------

    def _scan(self, codes: int) -> Iterator[tuple[int, bytes, _Record]]:
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
