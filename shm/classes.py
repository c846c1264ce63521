"""The shared class table: every class a write through the node may use.

``/queue-node.<name>.classes``, mode 0600, one slot a class, ``max_classes``
slots (from the configuration at the node's start). The supervisor creates it
and fills it with the classes of the rows in the store before any worker
starts; the HTTP workers and the keeper attach it. A class is named here as a
row carries it, ``(route, cadence_s or None for the route's default,
sitemap)``: one-to-one with node/core/classes.py's identity under any
configuration, and unchanged when a route's default cadence changes.

A write that brings classes the table does not hold reserves their slots all
at once, by compare-and-swap on ``used`` (``reserve``): ``used`` only grows,
never past ``limit``, so two workers racing for the last slot cannot both
win, and a write the table refused writes nothing (``too_many_classes``).
The keeper takes its classes from the same table (keeper/classes.py), so a
row written through the node always finds its class's slot there: no write
answered 200 is refused by the keeper for its class. Rows written straight
into the store by other programs can bring classes the table has no room
for: the keeper refuses those rows (``trust.apply.refused_classes``).

Slots are never given back while the node runs: a class whose rows are all
gone keeps its slot, and so does a class reserved by a write whose
transaction then failed (both are counted in ``used``). The next start of
the node builds the table afresh from the store.

Layout (little-endian, naturally aligned)::

    offset  size  field       format
    0       24    common header (shm/segment.py); owner pid: the supervisor
    24      8     used        Q    slots reserved; the CAS word, <= limit
    32      8     limit       Q    max_classes reservations honour (<= capacity;
                                   the keeper sets it from the configuration)
    40      8     capacity    Q    slots, as created
    48      16    reserved
    64            slot 0, then slot i at 64 + i * 144

    slot (144 bytes)
    +0      4     ready       I    1 once the identity below is written (release)
    +4      4     cadence_s   I    0: the route's default
    +8      2     route_len   H
    +10     1     sitemap     B
    +11     5     reserved
    +16     128   route       128s UTF-8

A slot is written once: after the CAS that reserved it, by the process that
won it, then ``ready`` is stored with release order; a reader loads ``ready``
with acquire order (``View.load32`` is sequentially consistent) before it
reads the identity. A reader that finds a reserved slot not yet ready waits
for it (a write in progress takes microseconds) up to ``PENDING_WAIT_S``:
a writer killed between its CAS and its ``ready`` leaves a slot that is
counted and names no class.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterable
from typing import Any

from node.core.classes import Carried
from node.core.errors import NodeError, TooManyClasses
from node.core.names import shm_segment_name
from node.core.rows import MAX_ROUTE_BYTES
from shm import segment
from shm.segment import HEADER_SIZE, Segment

try:
    from shm import _atomic
except ImportError as _exc:  # reported when the table is opened
    _atomic = None  # type: ignore[assignment]
    _ATOMIC_IMPORT_ERROR: ImportError | None = _exc
else:
    _ATOMIC_IMPORT_ERROR = None

LAYOUT_VERSION = 1
KIND = "classes"

USED_OFFSET = HEADER_SIZE  # 24
LIMIT_OFFSET = 32
CAPACITY_OFFSET = 40
FIRST_SLOT = 64
SLOT = struct.Struct(f"<IIHB5x{MAX_ROUTE_BYTES}s")
SLOT_SIZE = SLOT.size  # 144
IDENTITY = struct.Struct("<IHB")  # cadence_s, route_len, sitemap: at slot + 4
READY = 1
# How long a reader waits for a reserved slot to be written before it goes
# on without it (its writer was killed between the CAS and the write).
PENDING_WAIT_S = 1.0


def fits(triple: Carried) -> bool:
    """Whether a class can have a slot: its route is at most MAX_ROUTE_BYTES
    of UTF-8 and its cadence a u32 (the store refuses other rows anyway)."""
    route, cadence_s, _ = triple
    try:
        n = len(route.encode())
    except UnicodeEncodeError:
        return False
    return 0 < n <= MAX_ROUTE_BYTES and (cadence_s is None or 0 < cadence_s < 1 << 32)


class SharedClasses:
    """One process's mapping of the table, with what it has read of it.

    ``reserve`` is the only write a worker makes; the supervisor and the
    keeper use it too. Not thread-safe: one instance per thread that
    reserves (a worker reserves on its store thread only)."""

    def __init__(self, seg: Segment) -> None:
        if _atomic is None:
            raise NodeError(
                "the C extension shm._atomic is not built (the class table's CAS); "
                f"run `pip install -e .` ({_ATOMIC_IMPORT_ERROR})"
            )
        self.segment = seg
        self._view = _atomic.View(seg.mm)
        self.capacity = self._view.load64(CAPACITY_OFFSET)
        # What this process has read: every ready slot below _read, by name.
        self._known: dict[Carried, int] = {}
        self._read = 0

    # -- lifecycle (the supervisor creates and unlinks; everyone else attaches) --

    @classmethod
    def create(
        cls, node: str, capacity: int, identity: tuple[bytes, bytes] | None = None
    ) -> SharedClasses:
        """Supervisor, before any worker starts: a fresh, empty table
        (one a crash left is replaced: the store is the truth)."""
        if capacity < 1:
            raise ValueError(f"class table capacity {capacity} is not positive")
        name = shm_segment_name(node, KIND)
        identity = identity or segment.ANONYMOUS
        if segment.vet(name, LAYOUT_VERSION, identity[0]) is not None:
            segment.unlink(name)

        def init(mm: Any) -> None:
            struct.pack_into("<QQQ", mm, USED_OFFSET, 0, capacity, capacity)

        seg = segment.create(
            name, FIRST_SLOT + capacity * SLOT_SIZE, LAYOUT_VERSION, init=init, identity=identity
        )
        return cls(seg)

    @classmethod
    def attach(cls, node: str) -> SharedClasses:
        return cls(segment.attach(shm_segment_name(node, KIND), LAYOUT_VERSION))

    @staticmethod
    def unlink(node: str) -> bool:
        """Supervisor only."""
        return segment.unlink(shm_segment_name(node, KIND))

    def close(self) -> None:
        self._view.release()
        self.segment.close()

    def __enter__(self) -> SharedClasses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the words --------------------------------------------------------------

    @property
    def used(self) -> int:
        return self._view.load64(USED_OFFSET)

    @property
    def limit(self) -> int:
        return self._view.load64(LIMIT_OFFSET)

    def set_limit(self, max_classes: int) -> None:
        """The keeper, at start and at a reload: honour ``max_classes`` (at
        most the slots the table was made with)."""
        self._view.store64(LIMIT_OFFSET, min(max_classes, self.capacity))

    # -- reading ------------------------------------------------------------------

    def _slot_off(self, i: int) -> int:
        return FIRST_SLOT + i * SLOT_SIZE

    def _refresh(self, through: int) -> None:
        """Read the slots up to ``through`` (exclusive) this process has not
        read, waiting for reserved ones still being written."""
        mm, view = self.segment.mm, self._view
        deadline = None
        while self._read < through:
            off = self._slot_off(self._read)
            if view.load32(off) != READY:
                if deadline is None:
                    deadline = time.monotonic() + PENDING_WAIT_S
                if time.monotonic() < deadline:
                    os.sched_yield()
                    continue
                self._read += 1  # its writer died: counted, names nothing
                deadline = None
                continue
            cadence_s, route_len, sitemap = IDENTITY.unpack_from(mm, off + 4)
            route = bytes(mm[off + 16 : off + 16 + route_len]).decode()
            self._known.setdefault((route, cadence_s or None, bool(sitemap)), self._read)
            self._read += 1
            deadline = None

    def classes(self) -> set[Carried]:
        """Every class the table holds now."""
        self._refresh(min(self.used, self.capacity))
        return set(self._known)

    def __contains__(self, triple: object) -> bool:
        if triple in self._known:
            return True
        self._refresh(min(self.used, self.capacity))
        return triple in self._known

    # -- reserving ----------------------------------------------------------------

    def reserve(self, triples: Iterable[Carried]) -> int:
        """Make sure every class of ``triples`` has a slot: those the table
        lacks are reserved together, or none is (TooManyClasses when they
        would pass ``limit``; ValueError for one that ``fits`` refuses).
        Returns how many slots this call reserved."""
        known = self._known
        want = {t for t in ((r, c or None, bool(s)) for r, c, s in triples) if t not in known}
        for triple in want:
            if not fits(triple):
                raise ValueError(f"class {triple!r} cannot have a slot")
        view = self._view
        while want:
            used = view.load64(USED_OFFSET)
            # Every slot below `used` is read (waited for) before the CAS: a
            # CAS that succeeds saw no slot appear since, so what it adds
            # is in no slot yet.
            self._refresh(min(used, self.capacity))
            want = {t for t in want if t not in known}
            if not want:
                break
            limit = view.load64(LIMIT_OFFSET)
            total = used + len(want)
            if total > limit:
                raise TooManyClasses(
                    f"this write would make {total} classes ({len(want)} new); at most "
                    f"{limit} allowed (max_classes)",
                    "rows",
                )
            if view.cas64(USED_OFFSET, used, total) != used:
                continue  # another process reserved first: read its slots, try again
            mm = self.segment.mm
            for i, (route, cadence_s, sitemap) in enumerate(sorted(want, key=repr)):
                off = self._slot_off(used + i)
                raw = route.encode()
                SLOT.pack_into(mm, off, 0, cadence_s or 0, len(raw), int(sitemap), raw)
                view.release32(off, READY)
            return len(want)
        return 0


def attach_or_none(node: str) -> SharedClasses | None:
    """The node's table, or None when it cannot be mapped (no node of that
    name runs, or a build without it)."""
    try:
        return SharedClasses.attach(node)
    except (NodeError, OSError):
        return None
