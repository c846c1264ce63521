"""The state buffer: what the keeper knows about the queue, for readers on the host.

``/queue-node.<name>.state``, 1 MiB by default. The supervisor creates it (with
the node's start time), may give it a group so that an autoscaler running as
another user can map it read-only (mode 0640), and unlinks it at a clean
shutdown. The keeper is its only writer; everyone else attaches and closes.

Two parts. A fixed header, rewritten at every keeper publish (the heartbeat),
under its own seqlock; and the counts document (msgpack), written every few
seconds into one of two slots, each under its own seqlock: the keeper writes the
inactive slot and then flips ``active_doc``, so a reader always finds a
complete document.

Layout (little-endian, every field naturally aligned)::

    offset  size  field              format
    0       24    common header (magic, layout, writer pid, owner pid, size;
                  see shm/segment.py). writer pid: the keeper, stamped by its
                  first write. owner pid: the supervisor.
    24      4     status_gen         I    futex word: bumped and woken whenever
                                          status or exact changes
    28      4     header_seq         I    seqlock over 32..111, odd mid-write
    32      8     started_at         d    the node's start (wall), by the supervisor
    40      8     heartbeat_at       d    wall, at every keeper publish
    48      8     published_at       d    wall, the last ready-set publish
    56      8     first_publish_at   d    the first publish since started_at; 0 before
    64      8     generation         Q    publishes since started_at
    72      4     status             I    0 none, 1 loading, 2 live, 3 verifying, 4 stopped
    76      4     exact              I    0/1: loaded and caught up
    80      32    phase              32s  UTF-8, NUL-padded; empty = none
    112     4     active_doc         I    index of the newest complete document slot
    116     4     doc_capacity       I    bytes a document slot holds
    120     8     applied_seq        Q    the last change the keeper applied from the
                                          store's feed (0 before any, and while a
                                          keeper starts); stored with release,
                                          loaded with acquire
    128           document slot 0, then slot 1 at 128 + doc_stride

    document slot (doc_stride = 16 + doc_capacity, a multiple of 8)
    +0      4     seq                I    seqlock, odd mid-write
    +4      4     length             I    bytes of msgpack that follow
    +8      8     counts_at          d    wall time the counts were taken
    +16           msgpack document

Memory ordering (docs/shm.md, "Memory ordering"): both seqlocks are written
and read in C (``shm._atomic.seq_write``, ``seq_copy``), with the release and
acquire fences a weakly ordered CPU (aarch64) needs; ``active_doc`` and
``status_gen`` are stored with release and loaded with acquire. Those work on
a read-only mapping too.
"""

from __future__ import annotations

import os
import struct
import time
from typing import Any

import msgpack

from node.core.errors import NodeError, NodeNotRunning
from node.core.names import shm_segment_name
from shm import segment

try:
    from shm import _atomic
except ImportError as _exc:  # reported when a buffer is opened, with what to do
    _atomic = None  # type: ignore[assignment]
    _ATOMIC_IMPORT_ERROR: ImportError | None = _exc
else:
    _ATOMIC_IMPORT_ERROR = None
from shm.segment import HEADER_SIZE, U32, Segment, SnapshotUnstable, pid_alive

LAYOUT_VERSION = 1
KIND = "state"
DEFAULT_SIZE = 1 << 20

STATUS_GEN_OFFSET = HEADER_SIZE  # 24
HEADER_SEQ_OFFSET = 28
FIELDS_OFFSET = 32
# started_at, heartbeat_at, published_at, first_publish_at, generation, status, exact, phase
FIELDS = struct.Struct("<ddddQII32s")
DOC_INFO_OFFSET = 112
DOC_INFO = struct.Struct("<II")  # active_doc, doc_capacity
APPLIED_SEQ_OFFSET = 120
FIRST_DOC = 128
DOC_HEADER = struct.Struct("<IId")  # seq, length, counts_at
DOC_FIELDS = struct.Struct("<Id")  # length, counts_at: what the seqlock covers at +4
PHASE_BYTES = 32

STATUSES = ("none", "loading", "live", "verifying", "stopped")
STATUS_CODES = {name: code for code, name in enumerate(STATUSES)}
# The statuses a keeper vouches in (with exact, a fresh heartbeat and counts).
VOUCHING = frozenset(("live", "verifying"))
# The document's field ``write_doc`` signs it with: {"pid", "exact"}.
WRITER = "writer"

# The contract's vouching thresholds (CONTRACT.md, queue-state words).
# The keeper heartbeats at every publish, about once a second: 5 s of silence
# means it is stuck, not merely busy.
HEARTBEAT_MAX_AGE_S = 5.0
# Counts are written every 5 s; three missed writes mean they no longer
# describe the queue.
COUNTS_MAX_AGE_S = 15.0
# A reader gives up after this many torn copies in a row.
READ_RETRIES = 1000


class StateBuffer:
    def __init__(self, seg: Segment) -> None:
        if _atomic is None:
            raise NodeError(
                "the C extension shm._atomic is not built (the state buffer's seqlocks); "
                "run `pip install -e .` with gcc and the Python headers installed "
                f"({_ATOMIC_IMPORT_ERROR})"
            )
        self.segment = seg
        self.doc_capacity = DOC_INFO.unpack_from(seg.mm, DOC_INFO_OFFSET)[1]
        self._doc_stride = DOC_HEADER.size + self.doc_capacity
        self._stamped_pid = 0
        self._view: Any = None  # _atomic.View, for the keeper's applied_seq stores

    # -- lifecycle (the supervisor creates and unlinks; everyone else attaches) --

    @classmethod
    def create(
        cls,
        node: str,
        size: int = DEFAULT_SIZE,
        group: str | int | None = None,
        *,
        started_at: float,
        identity: tuple[bytes, bytes] | None = None,
    ) -> StateBuffer:
        """Supervisor: create the buffer, or reattach the one a crash left.

        On reattach the last document is kept (it is labelled with its
        ``counts_at``), and the header starts over for this run: status none,
        not exact, no publish yet since ``started_at``.
        """
        doc_capacity = ((size - FIRST_DOC) // 2 - DOC_HEADER.size) // 8 * 8
        if doc_capacity < 1024:
            raise ValueError(f"state buffer size {size} is too small (at least 4 KiB)")

        fresh = (started_at, 0.0, 0.0, 0.0, 0, STATUS_CODES["none"], 0, b"")

        def init(mm) -> None:
            FIELDS.pack_into(mm, FIELDS_OFFSET, *fresh)
            DOC_INFO.pack_into(mm, DOC_INFO_OFFSET, 0, doc_capacity)

        seg = segment.create_or_reattach(
            shm_segment_name(node, KIND),
            size,
            LAYOUT_VERSION,
            group=group,
            init=init,
            identity=identity,
        )
        buf = cls(seg)
        if seg.reattached:
            buf._write_fields(*fresh)
            buf._bump_status_gen()
        return buf

    @classmethod
    def attach(
        cls, node: str, read_only: bool = False, data_dir_id: bytes | None = None
    ) -> StateBuffer:
        """``read_only`` maps it read-only: enough for ``read``, and all a
        member of the buffer's group may do. With ``data_dir_id``, only the
        buffer of the node of that data directory (NameTaken otherwise)."""
        seg = segment.attach(
            shm_segment_name(node, KIND),
            LAYOUT_VERSION,
            read_only=read_only,
            data_dir_id=data_dir_id,
        )
        return cls(seg)

    @staticmethod
    def unlink(node: str) -> bool:
        """Supervisor only."""
        return segment.unlink(shm_segment_name(node, KIND))

    def close(self) -> None:
        self._view = None  # its export of the mapping first, or the close fails
        self.segment.close()

    def __enter__(self) -> StateBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writer (the keeper) ----------------------------------------------------

    def _stamp(self) -> None:
        pid = os.getpid()
        if self._stamped_pid != pid:
            self.segment.set_writer_pid(pid)
            self._stamped_pid = pid

    def _write_fields(self, *fields: Any) -> None:
        _atomic.seq_write(self.segment.mm, HEADER_SEQ_OFFSET, FIELDS_OFFSET, FIELDS.pack(*fields))

    def _bump_status_gen(self) -> None:
        mm = self.segment.mm
        gen = (U32.unpack_from(mm, STATUS_GEN_OFFSET)[0] + 1) & 0xFFFFFFFF
        # Release: a reader woken by it reads the header written before it.
        _atomic.release32(mm, STATUS_GEN_OFFSET, gen)
        self.segment.futex_wake(STATUS_GEN_OFFSET)

    def heartbeat(
        self,
        now: float,
        status: str,
        exact: bool,
        phase: str | None = None,
        published: bool = False,
    ) -> None:
        """The keeper's cheap header write, at every publish (``published=True``)
        and at every status change. A change of status or exactness wakes
        ``wait_status_change``. ``phase`` longer than 32 bytes is cut."""
        code = STATUS_CODES.get(status)
        if code is None:
            raise ValueError(f"status {status!r} is not one of {', '.join(STATUSES)}")
        self._stamp()
        # The keeper is the only writer, so its own fields need no seqlock here.
        started_at, _hb, published_at, first_at, generation, old_code, old_exact, _ph = (
            FIELDS.unpack_from(self.segment.mm, FIELDS_OFFSET)
        )
        if published:
            published_at = now
            generation += 1
            if first_at == 0.0:
                first_at = now
        # Cut to the field on a character boundary.
        phase_b = (phase or "").encode()[:PHASE_BYTES].decode(errors="ignore").encode()
        self._write_fields(
            started_at, now, published_at, first_at, generation, code, int(exact), phase_b
        )
        if code != old_code or int(exact) != old_exact:
            self._bump_status_gen()

    def note_applied(self, seq: int) -> None:
        """The keeper has applied the store's changes up to ``seq``: a
        program that wrote a change and read its seq sees when the keeper
        holds it (``bench/bench_keeper.py lag`` times commit to applied so)."""
        view = self._view
        if view is None:
            view = self._view = _atomic.View(self.segment.mm)
        view.store64(APPLIED_SEQ_OFFSET, seq)

    @property
    def applied_seq(self) -> int:
        """The last change the keeper applied from the store's feed."""
        return _atomic.acquire64(self.segment.mm, APPLIED_SEQ_OFFSET)

    def write_doc(self, doc: dict, now: float) -> None:
        """Write the counts document (msgpack), taken at ``now``, signed with
        its ``writer``: this process's pid and whether the header said live
        (or verifying) and exact when the counts were written. A reader
        vouches only for a document of the keeper that heartbeats now and
        that was exact when it counted: a keeper restarted after kill -9
        finds its predecessor's document in the buffer (and writes one of
        its own while it loads), and neither speaks for it."""
        self._stamp()
        code, exact = FIELDS.unpack_from(self.segment.mm, FIELDS_OFFSET)[5:7]
        vouching = code < len(STATUSES) and STATUSES[code] in VOUCHING
        writer = {"pid": os.getpid(), "exact": bool(exact) and vouching}
        blob = msgpack.packb({**doc, WRITER: writer}, use_bin_type=True)
        if len(blob) > self.doc_capacity:
            raise ValueError(
                f"state document is {len(blob)} bytes; a slot of this "
                f"{self.segment.size - segment.IDENTITY_SIZE}-byte buffer holds "
                f"{self.doc_capacity}"
            )
        mm = self.segment.mm
        active = DOC_INFO.unpack_from(mm, DOC_INFO_OFFSET)[0]
        slot = 1 - active
        base = FIRST_DOC + slot * self._doc_stride
        _atomic.seq_write(mm, base, base + 4, DOC_FIELDS.pack(len(blob), now) + blob)
        _atomic.release32(mm, DOC_INFO_OFFSET, slot)  # after the slot's seq is even

    # -- readers ----------------------------------------------------------------

    @property
    def status_gen(self) -> int:
        return _atomic.acquire32(self.segment.mm, STATUS_GEN_OFFSET)

    def wait_status_change(self, after_gen: int, timeout_s: float | None) -> int:
        """Block until ``status_gen`` differs from ``after_gen``; return it
        (``after_gen`` itself when ``timeout_s`` passes first)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            gen = self.status_gen
            if gen != after_gen:
                return gen
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return gen
            self.segment.futex_wait(STATUS_GEN_OFFSET, gen, remaining)

    def _read_fields(self) -> tuple:
        mm = self.segment.mm
        for _ in range(READ_RETRIES):
            got = _atomic.seq_copy(mm, HEADER_SEQ_OFFSET, FIELDS_OFFSET, FIELDS.size)
            if got is not None:
                return FIELDS.unpack(got[1])
            os.sched_yield()
        raise SnapshotUnstable(
            f"{self.segment.name}: header kept changing for {READ_RETRIES} tries"
        )

    def _read_doc(self) -> tuple[float, dict]:
        mm = self.segment.mm
        for _ in range(READ_RETRIES):
            active = _atomic.acquire32(mm, DOC_INFO_OFFSET) & 1
            base = FIRST_DOC + active * self._doc_stride
            # Two copies under the slot's seqlock: one document when both
            # read the same even seq.
            header = _atomic.seq_copy(mm, base, base, DOC_HEADER.size)
            if header is not None:
                seq, length, counts_at = DOC_HEADER.unpack(header[1])
                at = base + DOC_HEADER.size
                got = _atomic.seq_copy(mm, base, at, min(length, self.doc_capacity))
                if got is not None and got[0] == seq:
                    blob = got[1]
                    break
            os.sched_yield()
        else:
            raise SnapshotUnstable(
                f"{self.segment.name}: document kept changing for {READ_RETRIES} tries"
            )
        if length == 0:
            return 0.0, {}
        return counts_at, msgpack.unpackb(blob, raw=False, strict_map_key=False)

    def read(self) -> dict:
        started_at, heartbeat_at, published_at, first_at, generation, code, exact, phase = (
            self._read_fields()
        )
        counts_at, doc = self._read_doc()
        writer = doc.pop(WRITER, None)
        seg = self.segment
        return {
            "status": STATUSES[code] if code < len(STATUSES) else f"unknown({code})",
            "exact": bool(exact),
            "phase": phase.rstrip(b"\0").decode(errors="replace") or None,
            "heartbeat_at": heartbeat_at,
            "published_at": published_at,
            "first_publish_at": first_at,
            "started_at": started_at,
            "counts_at": counts_at,
            "generation": generation,
            "writer_pid": seg.writer_pid,
            # Who wrote the document, {"pid", "exact"} (``write_doc``).
            "counts_writer": writer if isinstance(writer, dict) else {},
            "owner_pid": seg.owner_pid,
            "boot_id": boot_id(seg),
            "doc": doc,
        }


def boot_id(seg: Segment) -> str | None:
    """The boot id the supervisor stamped, as hex; None on a segment with none."""
    ident = seg.identity
    return ident[1].hex() if ident is not None else None


def _age(now: float, at: float) -> float | None:
    return None if at == 0.0 else round(now - at, 3)


def _vouch(state: dict, now: float) -> tuple[bool, str | None]:
    """Whether the keeper vouches for the counts; if not, the first check that failed."""
    status = state["status"]
    pid = state["writer_pid"]
    hb_age = _age(now, state["heartbeat_at"])
    counts_age = _age(now, state["counts_at"])
    if not pid_alive(pid):
        return False, f"keeper process {pid} is not alive (last status {status})"
    if status not in VOUCHING:
        return False, status if status != "none" else "keeper has not started"
    if not state["exact"]:
        return False, "not exact: the keeper's copy is not caught up"
    if hb_age is None:
        return False, "keeper stalled: no heartbeat yet"
    if hb_age >= HEARTBEAT_MAX_AGE_S:
        return False, f"keeper stalled: heartbeat {hb_age:.1f} s old"
    if counts_age is None:
        return False, "counts stale: none written yet"
    writer = state.get("counts_writer") or {}
    if writer.get("pid") != pid:
        # The document of a keeper before this one (kill -9, a restart): the
        # new keeper has not counted yet.
        return False, f"counts stale: written by keeper process {writer.get('pid')}, not {pid}"
    if not writer.get("exact"):
        return False, "counts stale: taken before the keeper's copy was exact"
    if counts_age >= COUNTS_MAX_AGE_S:
        return False, f"counts stale: {counts_age:.1f} s old"
    return True, None


# -- the /queue-state document ----------------------------------------------------------
#
# One builder for ``GET /queue-state`` (workers/http/state.py) and ``read_state``
# (``python -m node state``, an autoscaler on the host), so the two cannot drift.
# The counts come from the keeper's document, taken at its ``counts_at``; the
# lease figures (in flight, held, parked) from the lease table, read now.

# The document's groups that ``queue_state`` reshapes; any other group of the
# document is passed through as it is.
_RESHAPED = frozenset(
    ["now", "coming", "lateness", "flow", "classes", "classes_truncated", "counters", "trust"]
)


def lease_counts(node: str) -> dict[str, int] | None:
    """The lease table's slots per state (``LeaseTable.code_counts``), or None
    when it cannot be mapped: the node runs without the work path, or this
    user may not map it (the table is 0600; the state buffer may be shared
    with a group, the lease table never is)."""
    try:
        from shm.leases import LeaseTable

        with LeaseTable.attach(node) as table:
            return table.code_counts()
    except (ImportError, NodeError, OSError):
        return None


def _paused(doc_now: dict) -> dict[str, Any]:
    return {
        "node": bool(doc_now.get("paused_node", False)),
        "routes": sorted(doc_now.get("paused") or []),
    }


def _leased(counts: dict[str, int] | None) -> dict[str, int | None]:
    if counts is None:
        return {"in_flight": None, "held": None, "parked": None}
    return {"in_flight": counts["leased"], "held": counts["held"], "parked": counts["parked"]}


def _unclaimed(due: Any, leased: dict[str, int | None]) -> int | None:
    """Due rows no lease, hold or parking keeps from a claim: an estimate.
    ``due`` is the keeper's count at ``counts_at``, the rest the lease table
    now, and a leased or held key need not be a due row (its row may have
    been rewritten to a later time since)."""
    total = due.get("total") if isinstance(due, dict) else None
    if total is None or leased["in_flight"] is None:
        return None
    return max(0, total - leased["in_flight"] - leased["held"] - leased["parked"])


def _trust(state: dict, doc: dict, now: float, reason: str | None) -> dict[str, Any]:
    hb_age = _age(now, state["heartbeat_at"])
    trust = dict(doc.get("trust") or {})
    verify = trust.get("verify") or {}
    trust.update(
        vouched=reason is None,
        # The keeper process is running and heartbeating, whether or not it
        # can vouch for its numbers yet (claimers are still served).
        live=pid_alive(state["writer_pid"]) and hb_age is not None and hb_age < HEARTBEAT_MAX_AGE_S,
        reason=reason,
        status=state["status"],
        phase=state["phase"],
        exact=state["exact"],
        counts_at=state["counts_at"] or None,
        state_age_s=_age(now, state["counts_at"]),
        heartbeat_age_s=hb_age,
        # Rows the verification walk put right (``total``), by cause: writes
        # the change feed missed, and rows a change of the fleet's node list
        # gained (``membership``: 0 until a fleet exists); and the rows the
        # re-read of each publish's top put right (``top``, not in ``total``).
        repairs={
            "total": verify.get("repairs", 0),
            "membership": verify.get("repairs_membership", 0),
            "feed_missed": verify.get("repairs_feed_missed", 0),
            "top": verify.get("top_repairs", 0),
        },
    )
    return trust


def not_vouched(
    trust: dict[str, Any], counts: dict[str, int] | None, paused: dict[str, Any], status: Any
) -> dict[str, Any]:
    """The answer when the keeper does not vouch: no counts at all, only what
    the lease table knows now and the last known pause."""
    return {
        "trust": trust,
        "now": {"in_flight": _leased(counts)["in_flight"], "paused": paused, "status": status},
    }


def unreadable_state(reason: str, counts: dict[str, int] | None = None) -> dict[str, Any]:
    """``not_vouched`` for a reader that could not read the buffer at all."""
    trust = {"vouched": False, "live": False, "reason": reason, "status": None}
    return not_vouched(trust, counts, {"node": False, "routes": []}, None)


def queue_state(state: dict, now: float, counts: dict[str, int] | None = None) -> dict:
    """The ``/queue-state`` document (docs/api.md) from a ``StateBuffer.read()``
    and the lease table's ``code_counts()`` (None: no lease figures).

    ``trust.vouched`` decides the shape: when false, only ``trust`` and
    ``now: {in_flight, paused, status}`` (``not_vouched``); the counts of a
    keeper that cannot vouch for them are not shown at all."""
    doc = state["doc"] or {}
    doc_now = doc.get("now") or {}
    vouched, reason = _vouch(state, now)
    trust = _trust(state, doc, now, reason)
    paused = _paused(doc_now)
    if not vouched:
        return not_vouched(trust, counts, paused, state["status"])
    leased = _leased(counts)
    kept = {k: v for k, v in doc_now.items() if k not in ("paused", "paused_node")}
    out: dict[str, Any] = {
        "now": {
            **kept,
            "at": state["counts_at"],
            **leased,
            "unclaimed": _unclaimed(doc_now.get("due"), leased),
            "paused": paused,
            "status": state["status"],
        },
        "coming": doc.get("coming"),
        "lateness": doc.get("lateness"),
        "flow": doc.get("flow"),
        "classes": {
            "rows": doc.get("classes") or [],
            "truncated": bool(doc.get("classes_truncated", False)),
        },
        "counters": doc.get("counters"),
    }
    for key, value in doc.items():
        if key not in _RESHAPED:
            out[key] = value
    out["trust"] = trust
    return out


def read_state(node: str, now: float | None = None) -> dict:
    """The node's queue state: what ``GET /queue-state`` answers (built by the
    same ``queue_state``), the lease figures included when this user can map
    the lease table.

    For readers on the host (an autoscaler, ``python -m node state``): maps the
    buffer read-only, reads it and closes it. Raises NodeNotRunning when no node
    of that name runs here (no buffer, or its supervisor is gone).
    """
    with StateBuffer.attach(node, read_only=True) as buf:
        state = buf.read()
    owner = state["owner_pid"]
    if not pid_alive(owner):
        raise NodeNotRunning(
            f"node {node!r} is not running: its supervisor (pid {owner}) is gone "
            f"and left {shm_segment_name(node, KIND)} behind"
        )
    counts = lease_counts(node)
    answer = queue_state(state, time.time() if now is None else now, counts)
    # Which start of the node this is: a reader that keeps a node's
    # segments tells by it that the node restarted.
    answer["trust"]["boot_id"] = state["boot_id"]
    return answer
