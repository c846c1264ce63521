"""What the ready set's two sides share: mapping and closing it, the active
slot, and the switch to a pending set (the protocol: shm/ready/layout.py)."""

from __future__ import annotations

from typing import Any, Self

from node.core.errors import NodeError
from node.core.names import shm_segment_name
from shm import segment
from shm.ready.layout import (
    ACTIVE_OFFSET,
    CHUNK,
    CURSOR_INDEX,
    ENTRY_SIZE,
    FIRST_SLOT,
    GENERATION_OFFSET,
    GRANT_UNTIL_OFFSET,
    KIND,
    LAYOUT_VERSION,
    READY_FIELDS,
    READY_FIELDS_OFFSET,
    RECORD,
    SLOT,
    SLOT_GENERATION,
    SLOT_HEADER_SIZE,
    U64,
    _records_at,
    _slot_stride,
    heap_size_for,
    segment_size_for,
)
from shm.segment import Segment

try:
    from shm import _atomic
except ImportError as _exc:  # reported when a claimer first takes, with what to do
    _atomic = None  # type: ignore[assignment]
    _ATOMIC_IMPORT_ERROR: ImportError | None = _exc
else:
    _ATOMIC_IMPORT_ERROR = None


class ReadySetBase:
    """The state of one handle on the ready set and what both sides use;
    ``ReadySet`` adds the keeper's side (``ReadyWriter``) and the claimers'
    (``ReadyReader``)."""

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
    def create(cls, node: str, capacity: int, identity: tuple[bytes, bytes] | None = None) -> Self:
        """Supervisor: create the segment, or reattach the one a crash left
        (``identity``: see ``segment.create_or_reattach``)."""
        if not 1 <= capacity <= 1 << 20:
            raise ValueError(f"ready set capacity {capacity} is not between 1 and {1 << 20}")

        def init(mm) -> None:
            READY_FIELDS.pack_into(mm, READY_FIELDS_OFFSET, capacity, heap_size_for(capacity))

        seg = segment.create_or_reattach(
            shm_segment_name(node, KIND),
            segment_size_for(capacity),
            LAYOUT_VERSION,
            init=init,
            identity=identity,
        )
        return cls(seg)

    @classmethod
    def attach(cls, node: str) -> Self:
        return cls(segment.attach(shm_segment_name(node, KIND), LAYOUT_VERSION))

    @staticmethod
    def unlink(node: str) -> bool:
        """Supervisor only."""
        return segment.unlink(shm_segment_name(node, KIND))

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _slot_base(self, index: int) -> int:
        return FIRST_SLOT + index * self._stride

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

    # -- the grant deadline (whoever renews the node's membership writes it) --

    def set_grant_until(self, ns: int) -> None:
        """Grant nothing once ``time.monotonic_ns()`` reaches ``ns`` (0: no
        deadline, a single node). Every take checks it (docs/fleet.md)."""
        if not 0 <= ns < 1 << 64:
            raise ValueError(f"grant_until {ns} is not a u64 of monotonic nanoseconds")
        view = self._view if self._view is not None else self._atomics()
        view.store64(GRANT_UNTIL_OFFSET, ns)

    @property
    def grant_until_ns(self) -> int:
        """The grant deadline in CLOCK_MONOTONIC nanoseconds; 0: none."""
        return _atomic.acquire64(self.segment.mm, GRANT_UNTIL_OFFSET)

    @property
    def active_slot(self) -> int:
        """The slot claimers take from now (0 or 1)."""
        return _atomic.acquire32(self.segment.mm, ACTIVE_OFFSET) & 1

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
