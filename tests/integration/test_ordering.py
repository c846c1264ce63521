"""Memory ordering: the fenced C functions behind every Python seqlock.

On aarch64 a plain ``struct`` read or write (memcpy, no fence) of a seqlock
counter or a publishing word may be seen out of order (docs/shm.md, "Memory
ordering"). These tests check three things:

- the C functions give the same answers, byte for byte, as the Python code
  they replace (kept here as the reference);
- a reader never returns a torn slot, set or document while a writer in
  another process rewrites it in a loop;
- the production paths call the fenced functions, so a regression to plain
  ``struct`` reads fails here.

On x86_64 (TSO) the torn-read tests exercise the protocols, not the fences
themselves; they were written and run without an aarch64 host.

Children are real processes (multiprocessing's 'spawn' context). Nothing
sleeps to synchronise: a test waits on a pipe, or polls up to a deadline.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import platform
import random
import struct
import time
import uuid
from pathlib import Path

import msgpack
import pytest

from node.core.names import shm_segment_name
from shm import _atomic, futex, leases, ready, segment, state
from shm.leases import (
    COPY_AT,
    INLINE_KEY,
    KEY_AT,
    KEY_META,
    KEYED,
    LEASED,
    RECORD,
    SLOT_SIZE,
    STATES,
    LeaseTable,
    _Record,
)
from shm.ready import SLOT, ReadyEntry, ReadySet
from shm.ready import take as ready_take
from shm.segment import U32
from shm.state import DOC_HEADER, FIELDS, FIELDS_OFFSET, HEADER_SEQ_OFFSET, StateBuffer

SPAWN = multiprocessing.get_context("spawn")
DEADLINE_S = 20.0
# Distinct values a torn-read test's reader must see the writer publish: the
# writer must really have been rewriting under it.
MIN_CHANGES = 20


def _new_node() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def node():
    name = _new_node()
    yield name
    for kind in ("ready", "state", "leases"):
        segment.unlink(shm_segment_name(name, kind))


def _anon(size: int = 4096) -> mmap.mmap:
    mm = mmap.mmap(-1, size)
    mm[:] = random.Random(7).randbytes(size)
    return mm


def _read_only(tmp_path: Path, data: bytes) -> tuple[mmap.mmap, int]:
    path = tmp_path / "ro"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    return mmap.mmap(fd, len(data), prot=mmap.PROT_READ), fd


# -- the Python code the C functions replace (the reference) -------------------


def _seq_copy_py(mm, seq_off: int, off: int, n: int) -> tuple[int, bytes] | None:
    seq = U32.unpack_from(mm, seq_off)[0]
    if seq % 2:
        return None
    data = bytes(mm[off : off + n])
    return (seq, data) if U32.unpack_from(mm, seq_off)[0] == seq else None


def _seq_write_py(mm, seq_off: int, off: int, data: bytes) -> int:
    seq = U32.unpack_from(mm, seq_off)[0]
    seq = (seq + 1 if seq % 2 == 0 else seq + 2) & 0xFFFFFFFF
    U32.pack_into(mm, seq_off, seq)
    mm[off : off + len(data)] = data
    U32.pack_into(mm, seq_off, (seq + 1) & 0xFFFFFFFF)
    return (seq + 1) & 0xFFFFFFFF


def _stable_py(table: LeaseTable, idx: int):
    """LeaseTable._stable as it was in Python (plain struct reads)."""
    mm = table.mm
    state_at = STATES + 8 * idx
    at = table._lay.slots + SLOT_SIZE * idx
    for _ in range(leases.READ_RETRIES):
        w = struct.unpack_from("<Q", mm, state_at)[0]
        if not (KEYED >> (w & 15)) & 1:
            return None
        key_len = KEY_META.unpack_from(mm, at)[0]
        if key_len <= INLINE_KEY:
            key = mm[at + KEY_AT : at + KEY_AT + key_len] if key_len else None
        else:
            key = table._read_key(idx)
        rec = _Record._make(RECORD.unpack_from(mm, at + COPY_AT[(w >> 8) & 1]))
        if struct.unpack_from("<Q", mm, state_at)[0] == w and key is not None:
            return w, key, rec
    return None


def _snapshot_py(rs: ReadySet):
    """ReadySet.snapshot's copy as it was in Python (plain struct reads)."""
    mm = rs.segment.mm
    active = U32.unpack_from(mm, ready.ACTIVE_OFFSET)[0]
    base = rs._slot_base(active & 1)
    seq, count, generation, published_at, _c, heap_used, flags = SLOT.unpack_from(mm, base)
    assert seq % 2 == 0
    at = base + ready.SLOT_HEADER_SIZE
    raw = mm[at : at + ready.ENTRY_SIZE * min(count, rs.capacity)]
    at = base + rs._heap_at
    heap = mm[at : at + min(heap_used, rs.heap_size)]
    return ready.ReadySnapshot(generation, published_at, ready._decode(raw, heap, count, flags))


# -- the C functions, byte for byte -------------------------------------------


@pytest.mark.parametrize(
    ("off", "n"), [(8, 0), (8, 8), (9, 7), (13, 100), (64, 1000), (3, 4000), (8, 4088)]
)
def test_seq_copy_matches_python_reads(off, n):
    mm = _anon()
    U32.pack_into(mm, 0, 41 * 2)
    assert _atomic.seq_copy(mm, 0, off, n) == _seq_copy_py(mm, 0, off, n) == (82, mm[off : off + n])
    U32.pack_into(mm, 0, 83)  # odd: mid-write
    assert _atomic.seq_copy(mm, 0, off, n) is None


def test_seq_copy_works_on_a_read_only_mapping(tmp_path):
    data = bytearray(random.Random(3).randbytes(256))
    U32.pack_into(data, 4, 6)
    mm, fd = _read_only(tmp_path, bytes(data))
    try:
        assert _atomic.seq_copy(mm, 4, 16, 100) == (6, bytes(data[16:116]))
        assert _atomic.acquire32(mm, 4) == 6
        assert _atomic.acquire64(mm, 8) == struct.unpack_from("<Q", data, 8)[0]
        with pytest.raises(BufferError):
            _atomic.release32(mm, 4, 8)  # a read-only buffer is never written
    finally:
        mm.close()
        os.close(fd)


def test_seq_copy_refuses_out_of_range_and_misaligned_words():
    mm = _anon(64)
    with pytest.raises(ValueError):
        _atomic.seq_copy(mm, 2, 8, 8)  # the counter is not an aligned u32
    with pytest.raises(ValueError):
        _atomic.seq_copy(mm, 0, 60, 8)  # past the end
    with pytest.raises(ValueError):
        _atomic.seq_copy(mm, 64, 0, 8)
    with pytest.raises(ValueError):
        _atomic.acquire64(mm, 4)


@pytest.mark.parametrize("start", [0, 7, 0xFFFFFFFE, 0xFFFFFFFF])
def test_seq_write_matches_the_python_writer(start):
    """The same bytes as the old Python writer, a counter a dead writer left
    odd, and the wrap at 2**32 included."""
    ours, theirs = _anon(), _anon()
    for mm in (ours, theirs):
        U32.pack_into(mm, 16, start)
    data = random.Random(start).randbytes(300)
    assert _atomic.seq_write(ours, 16, 21, data) == _seq_write_py(theirs, 16, 21, data)
    assert ours[:] == theirs[:]
    assert U32.unpack_from(ours, 16)[0] % 2 == 0


def test_view_seqlock_words_match_struct():
    mm = _anon()
    view = _atomic.View(mm)
    try:
        for off in (0, 4, 64, 4092):
            now = U32.unpack_from(mm, off)[0]
            assert view.check32(off, now) is True
            assert view.check32(off, (now + 1) & 0xFFFFFFFF) is False
            assert view.load32(off) == now
        for off in (0, 8, 4088):
            now = struct.unpack_from("<Q", mm, off)[0]
            assert view.check64(off, now) is True
            assert view.check64(off, now ^ 1) is False
        view.begin32(4, 0xFFFFFFFF)
        assert U32.unpack_from(mm, 4)[0] == 0xFFFFFFFF
        view.release32(4, 12)
        assert U32.unpack_from(mm, 4)[0] == 12
        with pytest.raises(ValueError):
            view.check32(2, 0)
        with pytest.raises(ValueError):
            view.check64(4, 0)
        with pytest.raises(OverflowError):
            view.release32(4, 1 << 32)
    finally:
        view.release()


def test_read_slot_matches_the_python_stable(node):
    """Every slot, keyed or not, short keys and keys continued in an overflow
    block, leased, held and released: the C read gives what the Python one did."""
    with LeaseTable.create(node, capacity=64) as table:
        now = 1_700_000_000.0
        keys = [f"k{i}" for i in range(20)] + [
            f"long-{i}-" + "x" * (200 + 90 * i) for i in range(6)
        ]
        for i, key in enumerate(keys):
            lease = table.grant(key, f"consumer-{i}", 30.0, now, 60.0, version=i)
            assert isinstance(lease, leases.Lease), lease
            if i % 3 == 0:
                assert table.release(key, lease.lease_id, now, error=f"e{i}") is not None
            elif i % 5 == 0:
                assert table.complete(key, lease.lease_id, now) is not None
        seen = 0
        for idx in range(table.capacity):
            ours, theirs = table._stable(idx), _stable_py(table, idx)
            assert ours == theirs, idx
            seen += ours is not None
        assert seen >= len(keys) - len(keys) // 5


def test_futex_syscall_number_is_this_machines():
    assert segment.SYS_FUTEX == _atomic.SYS_futex
    expected = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
    if expected is not None:
        assert segment.SYS_FUTEX == expected
    assert futex._SYS_FUTEX_BY_MACHINE["aarch64"] == 98
    assert futex._SYS_FUTEX_BY_MACHINE["x86_64"] == 202


# -- the production paths use the fenced functions ------------------------------


class _Recording:
    """Delegates to ``inner`` and records the names of the calls made."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)

        return call


def _entries(g: int, n: int) -> list[tuple[str, int, int, int, float]]:
    return [(f"k{g}-{j}-" + "p" * (g % 37), g, g, g % 60_000, float(g)) for j in range(n)]


def test_ready_publish_and_take_go_through_the_fences(node, monkeypatch):
    with ReadySet.create(node, capacity=64) as rs:
        view = _Recording(rs._atomics())
        rs._view = view
        rs.publish(_entries(1, 10), 1.0)
        assert view.calls.count("begin32") == 1
        assert view.calls.count("release32") == 1
        assert "store64" in view.calls  # low_water, then the switch word
        # The header the publish wrote, as the old writer wrote it.
        base = rs._slot_base(rs.active_slot)
        assert SLOT.unpack_from(rs.segment.mm, base)[:5] == (2, 10, 1, 1.0, 2 << 32)
        view.calls.clear()
        generation, taken = rs.take(3)
        assert (generation, [e.key for e in taken]) == (1, ["k1-0-p", "k1-1-p", "k1-2-p"])
        # The grant deadline, the switch word, the slot's seq, then the cursor.
        assert view.calls[:4] == ["load64", "load64", "load32", "add64"]
        assert view.calls[-1] == "check32"
        rs._view = view._inner

        module = _Recording(_atomic)
        monkeypatch.setattr(ready_take, "_atomic", module)  # the readers' module
        assert rs.snapshot() == _snapshot_py(rs)
        assert module.calls.count("seq_copy") == 3
        module.calls.clear()
        assert rs.generation == 1
        assert module.calls == ["acquire64", "acquire64"]


def test_state_buffer_goes_through_the_fences(node, monkeypatch):
    module = _Recording(_atomic)
    monkeypatch.setattr(state, "_atomic", module)
    with StateBuffer.create(node, 64 * 1024, started_at=5.0) as buf:
        module.calls.clear()
        buf.heartbeat(6.0, "live", True, phase="p")
        assert module.calls == ["seq_write", "release32"]  # the header; status_gen
        module.calls.clear()
        buf.write_doc({"a": 1}, 7.0)
        assert module.calls == ["seq_write", "release32"]  # the document; active_doc
        module.calls.clear()
        got = buf.read()
        assert (got["status"], got["phase"], got["doc"], got["counts_at"]) == (
            "live",
            "p",
            {"a": 1},
            7.0,
        )
        assert module.calls == ["seq_copy", "acquire32", "seq_copy", "seq_copy"]


def test_lease_reads_go_through_read_slot(node):
    with LeaseTable.create(node, capacity=64) as table:
        lease = table.grant("key", "c", 30.0, 100.0, 60.0)
        view = _Recording(table._view)
        table._view = view
        try:
            assert table.peek("key", lease.lease_id)[0] == leases.Outcome.COMPLETED
            assert "read_slot" in view.calls
            view.calls.clear()
            assert [lease.key for lease in table.live()] == ["key"]
            assert "read_slot" in view.calls
        finally:
            table._view = view._inner


def test_state_buffer_bytes_match_the_python_writer(node):
    """The C seqlock writer leaves the buffer as the Python one did."""
    other = _new_node()
    try:
        with (
            StateBuffer.create(node, 64 * 1024, started_at=5.0) as ours,
            StateBuffer.create(other, 64 * 1024, started_at=5.0) as theirs,
        ):
            fields = (5.0, 6.0, 7.0, 8.0, 9, 2, 1, b"phase")
            ours._write_fields(*fields)
            _seq_write_py(theirs.segment.mm, HEADER_SEQ_OFFSET, FIELDS_OFFSET, FIELDS.pack(*fields))
            # write_doc signs the document: its pid, exact (live and exact above)
            writer = {"pid": os.getpid(), "exact": True}
            blob = msgpack.packb({"a": 1, "writer": writer}, use_bin_type=True)
            ours.write_doc({"a": 1}, 11.5)
            mm = theirs.segment.mm
            base = state.FIRST_DOC + theirs._doc_stride
            _seq_write_py(mm, base, base + 4, struct.pack("<Id", len(blob), 11.5) + blob)
            U32.pack_into(mm, state.DOC_INFO_OFFSET, 1)
            end = state.FIRST_DOC + 2 * ours._doc_stride
            assert ours.segment.mm[24:end] == theirs.segment.mm[24:end]
            assert DOC_HEADER.unpack_from(ours.segment.mm, base) == (2, len(blob), 11.5)
            assert ours.read()["doc"] == {"a": 1}
    finally:
        segment.unlink(shm_segment_name(other, "state"))


# -- torn reads: a writer process rewrites in a loop, this process reads --------


def _record_for(i: int) -> _Record:
    consumer = f"c{i}".encode()
    error = f"e{i}".encode()
    return _Record(
        i, float(i), i + 0.5, i + 0.25, 30.0, float(i % 97), i % 1000, 1,
        len(consumer), len(error), consumer, error, i * 3,
    )  # fmt: skip


def _consistent_record(rec: _Record) -> int:
    """The writer's i, asserting that every field of the record came from it."""
    i = rec.lease_id
    assert rec == _Record._make(RECORD.unpack(RECORD.pack(*_record_for(i)))), rec
    return i


def _lease_writer(node: str, idx: int, stop, conn) -> None:
    table = LeaseTable.attach(node)
    i = 1
    while not stop.is_set():
        got = table._stable(idx)
        own = table._take(idx, got[0])
        if own is None:
            continue
        i += 1
        table._update(idx, own, _record_for(i), LEASED)
        if i == 2:
            conn.send("writing")
    table.close()
    conn.send(i)


def _ready_writer(node: str, stop, conn) -> None:
    rs = ReadySet.attach(node)
    g = rs.generation
    while not stop.is_set():
        g += 1
        rs.publish(_entries(g, 5 + g % 40), float(g))
        if g == 2:
            conn.send("writing")
    rs.close()
    conn.send(g)


def _state_writer(node: str, stop, conn) -> None:
    buf = StateBuffer.attach(node)
    i = 0
    while not stop.is_set():
        i += 1
        buf.heartbeat(float(i), "live", True, phase=str(i), published=True)
        buf.write_doc({"i": i, "pad": "y" * (i % 997)}, float(i))
        if i == 1:
            conn.send("writing")
    buf.close()
    conn.send(i)


def _run_against(writer, args, read_one) -> set[int]:
    """Start ``writer`` in a child and call ``read_one`` until it has seen
    MIN_CHANGES distinct values (each read asserts its own consistency)."""
    stop = SPAWN.Event()
    parent_end, child_end = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=writer, args=(*args, stop, child_end), daemon=True)
    proc.start()
    child_end.close()
    seen: set[int] = set()
    try:
        assert parent_end.poll(DEADLINE_S), "the writer did not start"
        assert parent_end.recv() == "writing"
        deadline = time.monotonic() + DEADLINE_S
        reads = 0
        while (len(seen) < MIN_CHANGES * 50 or reads < 20_000) and time.monotonic() < deadline:
            seen.add(read_one())
            reads += 1
        assert len(seen) >= MIN_CHANGES, f"{reads} reads saw only {len(seen)} values"
    finally:
        stop.set()
        proc.join(DEADLINE_S)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    return seen


def test_lease_slot_read_is_never_torn(node):
    key = "torn-" + "z" * 300  # continued in an overflow block
    with LeaseTable.create(node, capacity=64) as table:
        assert isinstance(table.grant(key, "c", 30.0, 1.0, 60.0), leases.Lease)
        idx = table._lookup(key.encode(), leases._hash(key.encode()))[0]
        table._update(idx, table._take(idx, table._stable(idx)[0]), _record_for(1), LEASED)

        def read_one() -> int:
            got = table._stable(idx)
            assert got is not None  # the writer takes and publishes in microseconds
            w, got_key, rec = got
            assert got_key == key.encode()
            assert w & 15 in (LEASED, leases.UPDATING)
            return _consistent_record(rec)

        _run_against(_lease_writer, (node, idx), read_one)


def test_ready_set_snapshot_and_take_are_never_torn(node):
    with ReadySet.create(node, capacity=64) as rs:
        rs.publish(_entries(1, 5), 1.0)

        def check(generation: int, entries: list[ReadyEntry], start: int = 0) -> int:
            for j, entry in enumerate(entries, start):
                assert entry == ReadyEntry(
                    f"k{generation}-{j}-" + "p" * (generation % 37),
                    generation,
                    generation,
                    generation % 60_000,
                    float(generation),
                ), (generation, j, entry)
            return generation

        def read_one() -> int:
            snap = rs.snapshot()
            assert snap.published_at == float(snap.generation)
            assert len(snap.entries) == 5 + snap.generation % 40
            check(snap.generation, snap.entries)
            generation, taken = rs.take(2)
            if taken:
                first = int(taken[0].key.split("-")[1])
                check(generation, taken, first)
            return snap.generation

        _run_against(_ready_writer, (node,), read_one)


def test_state_buffer_header_and_document_are_never_torn(node):
    with StateBuffer.create(node, 64 * 1024, started_at=0.5) as buf:
        buf.heartbeat(0.0, "live", True, phase="0")
        buf.write_doc({"i": 0, "pad": ""}, 0.0)

        def read_one() -> int:
            got = buf.read()
            assert got["heartbeat_at"] == got["published_at"] == float(got["phase"])
            assert got["generation"] == int(got["heartbeat_at"])
            doc = got["doc"]
            assert got["counts_at"] == float(doc["i"])
            assert doc["pad"] == "y" * (doc["i"] % 997)
            return doc["i"]

        _run_against(_state_writer, (node,), read_one)
