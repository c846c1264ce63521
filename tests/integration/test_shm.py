"""Shared memory between real processes: torn reads, futex wake-ups, names, modes.

Children are real processes (multiprocessing's 'spawn' context, or a separate
interpreter through subprocess where the point is an unrelated program).
Nothing here sleeps to synchronise: a test waits on a pipe, or polls a
condition up to a deadline.
"""

from __future__ import annotations

import grp
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from node.core.errors import LayoutMismatch, NodeError, NodeNotRunning
from node.core.names import shm_segment_name
from shm import segment
from shm.ready import ReadySet, heap_size_for
from shm.segment import futex_wait, futex_wake, pid_alive
from shm.state import HEARTBEAT_MAX_AGE_S, StateBuffer, read_state
from shm.wake import WAKE_CAP, Wake
from tests.procs import wait_until

SPAWN = multiprocessing.get_context("spawn")
ROOT = Path(__file__).resolve().parents[2]
SYS_FUTEX = str(segment.SYS_FUTEX)  # this machine's (202 on x86_64, 98 on aarch64)
DEADLINE_S = 10.0


def _new_node() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def _unlink_all(name: str) -> None:
    for kind in ("ready", "state", "leases"):
        segment.unlink(shm_segment_name(name, kind))
    Wake.unlink(name)


@pytest.fixture
def node():
    name = _new_node()
    yield name
    _unlink_all(name)


@pytest.fixture
def other_node():
    name = _new_node()
    yield name
    _unlink_all(name)


def _shm_path(name: str, kind: str) -> Path:
    return Path("/dev/shm") / shm_segment_name(name, kind).lstrip("/")



def _in_futex(pid: int) -> bool:
    """Whether the process's main thread is blocked in futex(2) right now."""
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0] == SYS_FUTEX
    except (OSError, IndexError):
        return False


def _run_child(code: str) -> subprocess.CompletedProcess:
    """An unrelated program on the host: a fresh interpreter, not a fork."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=True,
    )


# -- children (module level so that 'spawn' can find them) ----------------------


def _tagged_set(gen: int) -> list[tuple[str, int, int, int, float]]:
    """Every entry of publish ``gen`` is derived from ``gen``; sizes vary."""
    n = 1 + (gen * 37) % 200
    pad = ("é" if gen % 7 == 0 else "x") * (gen % 40)
    return [
        (f"g{gen}-{i}-{pad}", gen, gen * 1000 + i, gen % 65536, gen + i / 1024) for i in range(n)
    ]


def _check_snapshot(snap) -> str | None:
    if snap.generation == 0:
        return None if snap.entries == [] else "generation 0 is not empty"
    expected = _tagged_set(snap.generation)
    if [tuple(e) for e in snap.entries] != expected:
        return f"generation {snap.generation}: entries do not match their tag"
    if snap.published_at != float(snap.generation):
        return f"generation {snap.generation}: published_at {snap.published_at}"
    return None


def _writer(name: str, stop, conn) -> None:
    ready = ReadySet.attach(name)
    gen = ready.generation
    conn.send("started")
    while not stop.is_set():
        gen += 1
        ready.publish(_tagged_set(gen), float(gen))
    ready.close()
    conn.send(gen)


def _reader(name: str, want_generations: int, deadline_s: float, conn) -> None:
    ready = ReadySet.attach(name)
    deadline = time.monotonic() + deadline_s
    seen: set[int] = set()
    errors: list[str] = []
    snapshots = 0
    while len(seen) < want_generations and time.monotonic() < deadline:
        try:
            snap = ready.snapshot()
            problem = _check_snapshot(snap)
        except Exception as exc:  # noqa: BLE001 - a torn copy may not even decode
            errors.append(repr(exc))
            continue
        snapshots += 1
        seen.add(snap.generation)
        if problem is not None:
            errors.append(problem)
    conn.send(
        {
            "snapshots": snapshots,
            "generations": len(seen),
            "retries": ready.retries,
            "errors": errors[:5],
        }
    )
    ready.close()


def _block_then_report(name: str, what: str, after: int, conn) -> None:
    """Say "waiting", block on ``what`` for up to 30 s, send what woke it."""
    if what == "ready":
        handle = ReadySet.attach(name)
        conn.send("waiting")
        t0 = time.monotonic()
        result = handle.wait_publish(after, 30.0)
    elif what == "state":
        handle = StateBuffer.attach(name, read_only=True)
        conn.send("waiting")
        t0 = time.monotonic()
        result = handle.wait_status_change(after, 30.0)
    else:
        handle = Wake.attach(name)
        conn.send("waiting")
        t0 = time.monotonic()
        result = handle.wait(30.0)
    conn.send((result, time.monotonic() - t0))
    handle.close()


def _start(target, *args):
    parent_end, child_end = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=target, args=(*args, child_end), daemon=True)
    proc.start()
    child_end.close()
    return proc, parent_end


def _recv(conn, what: str, deadline_s: float = DEADLINE_S):
    if not conn.poll(deadline_s):
        raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")
    return conn.recv()


# -- the ready set ------------------------------------------------------------


def test_publish_and_snapshot_round_trip(node):
    with ReadySet.create(node, capacity=1000) as ready:
        assert ready.snapshot() == (0, 0.0, [])
        entries = [
            (f"https://example.com/{i}", i, 29_000_000 + i, i % 7, 2.5 - i) for i in range(500)
        ]
        assert ready.publish(entries, 1700000000.5) == 500
        snap = ready.snapshot()
        assert snap.generation == ready.generation == 1
        assert snap.published_at == 1700000000.5
        assert [tuple(e) for e in snap.entries] == entries
        assert snap.entries[3].key == "https://example.com/3"
        assert snap.entries[3].due_minute == 29_000_003

        unicode = [("ключ/é/" + str(i), 2**63 + i, -5, 65535, 0.25) for i in range(10)]
        assert ready.publish(unicode, 2.0) == 10
        assert [tuple(e) for e in ready.snapshot().entries] == unicode

        assert ready.publish([], 3.0) == 0
        assert ready.snapshot() == (3, 3.0, [])


@pytest.mark.parametrize("size", [1, 7, 255, 256, 257, 600, 777, 1000])
def test_every_set_size_round_trips(node, size):
    rows = [(f"k{size}-{i}", i, -i, i % 65536, i * 0.5) for i in range(size)]
    with ReadySet.create(node, capacity=1000) as ready:
        assert ready.publish(rows, 1.0) == size
        assert [tuple(e) for e in ready.snapshot().entries] == rows


def test_publish_columns_is_publish_without_the_tuples(node):
    entries = [(f"key-{i}", i, 100 + i, i % 3, i / 3) for i in range(300)]
    with ReadySet.create(node, capacity=200) as ready:
        assert ready.publish_columns(*map(list, zip(*entries, strict=True)), 5.0) == 200
        assert [tuple(e) for e in ready.snapshot().entries] == entries[:200]
        with pytest.raises(ValueError, match="differ in length"):
            ready.publish_columns(["a", "b"], [1], [1, 2], [1, 2], [1.0, 2.0], 6.0)
        assert ready.generation == 1


def test_publish_caps_at_capacity_and_at_key_space(node):
    with ReadySet.create(node, capacity=300) as ready:
        many = [(f"k{i}", i, i, 0, 0.0) for i in range(400)]
        assert ready.publish(many, 1.0) == 300
        assert [e.key for e in ready.snapshot().entries] == [f"k{i}" for i in range(300)]

        long_keys = [(f"{i:04d}" + "k" * 996, i, i, 0, 0.0) for i in range(300)]
        written = ready.publish(long_keys, 2.0)
        assert written == heap_size_for(300) // 1000 == 142
        snap = ready.snapshot()
        assert [tuple(e) for e in snap.entries] == long_keys[:written]


def test_a_heap_that_fills_in_a_later_chunk_keeps_the_earlier_chunks(node):
    with ReadySet.create(node, capacity=1000) as ready:
        rows = [(f"{i:04d}" + "é" * 298, i, i, 1, 1.0) for i in range(1000)]  # 600 bytes each
        written = ready.publish(rows, 1.0)
        assert written == heap_size_for(1000) // 600 == 535
        assert [tuple(e) for e in ready.snapshot().entries] == rows[:written]


@pytest.mark.parametrize("seed", range(4))
def test_columns_written_in_c_are_the_bytes_the_python_packing_writes(node, other_node, seed):
    """publish_columns of lists goes through _atomic.View.write_entries; of
    other sequences, through the chunked Python packing. The same set gives
    the same slot, byte for byte: entries, heap, count, heap used, flags,
    also when the heap fills part-way and when a key is not ASCII."""
    import random

    from shm.ready import FIRST_SLOT, SLOT_HEADER_SIZE

    rnd = random.Random(seed)
    capacity = 300
    n = rnd.choice([0, 1, 255, 256, 257, 300, 400])
    long_keys = seed % 2 == 1  # 300 keys of ~500 bytes overflow the heap
    keys = [
        f"k{i}-" + ("é" if rnd.random() < 0.1 else "x") * (rnd.randrange(400, 600) if long_keys
                                                            else rnd.randrange(0, 40))
        for i in range(n)
    ]
    cols = (
        keys,
        [rnd.getrandbits(64) for _ in range(n)],
        [rnd.randrange(-(1 << 40), 1 << 40) for _ in range(n)],
        [rnd.randrange(1 << 16) for _ in range(n)],
        [rnd.uniform(-5, 5) for _ in range(n)],
    )
    with ReadySet.create(node, capacity) as c_ready, ReadySet.create(other_node, capacity) as py:
        c_count = c_ready.publish_columns(*cols, 1.0)
        py_count = py.publish_columns(*map(tuple, cols), 1.0)
        assert c_count == py_count == len(c_ready.snapshot().entries)
        assert [tuple(e) for e in c_ready.snapshot().entries] == [
            tuple(e) for e in py.snapshot().entries
        ]
        base = FIRST_SLOT + c_ready.last_slot * c_ready._stride
        head = slice(base + 4, base + 16)  # count, generation: the same publish
        rest = slice(base + 32, base + SLOT_HEADER_SIZE + c_ready._heap_at - SLOT_HEADER_SIZE
                     + c_ready.heap_size)
        assert c_ready.segment.mm[head] == py.segment.mm[head]
        assert c_ready.segment.mm[rest] == py.segment.mm[rest]


def test_a_bad_column_entry_written_in_c_is_refused_and_the_last_set_stays(node):
    with ReadySet.create(node, capacity=10) as ready:
        ready.publish_columns(["a"], [1], [1], [1], [1.0], 1.0)
        for bad in (
            (["b"], [1], [1], [70_000], [1.0]),  # class_id is u16
            (["b"], [-1], [1], [1], [1.0]),  # version is u64
            (["b"], [1], [1 << 63], [1], [1.0]),  # due_minute is i64
            (["b" * 66_000], [1], [1], [1], [1.0]),  # key_len is u16 (the heap holds it)
        ):
            with pytest.raises(ValueError, match="does not fit"):
                ready.publish_columns(*bad, 2.0)
            snap = ready.snapshot()
            assert snap.generation == 1 and snap.entries[0].key == "a"
        with pytest.raises(TypeError):
            ready.publish_columns([b"bytes"], [1], [1], [1], [1.0], 2.0)
        ready.publish_columns(["c"], [1], [1], [1], [1.0], 3.0)
        assert ready.snapshot().entries[0].key == "c"


def test_a_bad_entry_is_refused_and_the_last_set_stays(node):
    with ReadySet.create(node, capacity=10) as ready:
        ready.publish([("a", 1, 1, 1, 1.0)], 1.0)
        with pytest.raises(ValueError, match="does not fit"):
            ready.publish([("b", 1, 1, 70_000, 1.0)], 2.0)  # class_id is u16
        snap = ready.snapshot()
        assert snap.generation == 1 and snap.entries[0].key == "a"
        ready.publish([("c", 1, 1, 1, 1.0)], 3.0)
        assert ready.snapshot().entries[0].key == "c"


@pytest.mark.timeout(30)
def test_readers_never_see_a_torn_set_while_a_writer_publishes(node):
    ready = ReadySet.create(node, capacity=512)
    stop = SPAWN.Event()
    writer, writer_conn = _start(_writer, node, stop)
    readers = [_start(_reader, node, 3000, 4.0) for _ in range(3)]
    try:
        assert _recv(writer_conn, "the writer to start") == "started"
        results = [_recv(conn, "a reader's result", 15.0) for _proc, conn in readers]
        stop.set()
        last = _recv(writer_conn, "the writer to stop")
    finally:
        stop.set()
        for proc in [writer] + [proc for proc, _conn in readers]:
            proc.join(DEADLINE_S)
        ready.close()
    for result in results:
        assert result["errors"] == []
        # Enough distinct sets went by for the check to mean something.
        assert result["generations"] >= 50, result
    assert last >= max(r["generations"] for r in results)
    assert [proc.exitcode for proc, _conn in readers] == [0, 0, 0] and writer.exitcode == 0


@pytest.mark.timeout(30)
def test_publish_wakes_a_process_waiting_on_the_futex(node):
    with ReadySet.create(node, capacity=10) as ready:
        proc, conn = _start(_block_then_report, node, "ready", 0)
        try:
            assert _recv(conn, "the child to start waiting") == "waiting"
            wait_until(lambda: _in_futex(proc.pid), "the child to block in futex(2)")
            ready.publish([("k", 1, 1, 1, 1.0)], 1.0)
            generation, waited_s = _recv(conn, "the woken child", 5.0)
        finally:
            proc.join(DEADLINE_S)
        assert generation == 1
        assert waited_s < 5.0


def test_wait_publish_times_out_with_the_same_generation(node):
    with ReadySet.create(node, capacity=10) as ready:
        assert ready.wait_publish(0, 0.05) == 0
        ready.publish([("k", 1, 1, 1, 1.0)], 1.0)
        assert ready.wait_publish(0, 0.05) == 1


@pytest.mark.timeout(30)
def test_close_refuses_to_unmap_under_a_waiting_thread(node):
    ready = ReadySet.create(node, capacity=10)
    other = ReadySet.attach(node)
    tids: list[int] = []
    woke: list[int] = []

    def wait() -> None:
        tids.append(threading.get_native_id())
        woke.append(ready.wait_publish(0, 30.0))

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()

    def blocked() -> bool:
        if not tids:
            return False
        try:
            task = Path(f"/proc/self/task/{tids[0]}/syscall").read_text()
        except OSError:
            return False
        return task.split()[0] == SYS_FUTEX

    try:
        wait_until(blocked, "the thread to block in futex(2)")
        with pytest.raises(BufferError, match="futex wait"):
            ready.close()
        other.publish([("k", 1, 1, 1, 1.0)], 1.0)
        thread.join(DEADLINE_S)
        assert woke == [1]
        ready.close()
        assert ready.segment.closed
    finally:
        other.close()


def test_futex_helpers_on_a_plain_mapping(node):
    with ReadySet.create(node, capacity=10) as ready:
        mm = ready.segment.mm
        offset = 28  # the generation word: 0
        assert futex_wait(mm, offset, 1, 1.0) is True  # the word is not 1: returns at once
        assert futex_wait(mm, offset, 0, 0.01) is False  # nobody wakes it
        assert futex_wake(mm, offset) == 0
        with pytest.raises(ValueError, match="aligned"):
            futex_wait(mm, 30, 0, 0.01)


# -- names, modes, layouts, owners --------------------------------------------


def test_segments_are_private_to_the_user(node):
    ready = ReadySet.create(node, capacity=10)
    state = StateBuffer.create(node, started_at=1.0)
    wake = Wake.create(node)
    try:
        assert stat.S_IMODE(_shm_path(node, "ready").stat().st_mode) == 0o600
        assert stat.S_IMODE(_shm_path(node, "state").stat().st_mode) == 0o600
        sem_path = Path("/dev/shm") / f"sem.{shm_segment_name(node, 'wake').lstrip('/')}"
        assert stat.S_IMODE(sem_path.stat().st_mode) == 0o600
    finally:
        for handle in (ready, state, wake):
            handle.close()


def test_the_state_buffer_may_be_given_a_group(node):
    gid = os.getgid()
    with StateBuffer.create(node, group=grp.getgrgid(gid).gr_name, started_at=1.0):
        info = _shm_path(node, "state").stat()
        assert stat.S_IMODE(info.st_mode) == 0o640
        assert info.st_gid == gid
    with StateBuffer.attach(node, read_only=True) as reader:
        assert reader.read()["status"] == "none"
        assert reader.segment.read_only


def test_two_nodes_never_see_each_other(node, other_node):
    with ReadySet.create(node, capacity=10) as a:
        a.publish([("from-a", 1, 1, 1, 1.0)], 1.0)
        with pytest.raises(NodeNotRunning):
            ReadySet.attach(other_node)
        with pytest.raises(NodeNotRunning):
            StateBuffer.attach(other_node)
        with ReadySet.create(other_node, capacity=10) as b:
            b.publish([("from-b", 1, 1, 1, 1.0)], 1.0)
            b.publish([("from-b2", 1, 1, 1, 1.0)], 2.0)
            assert [e.key for e in a.snapshot().entries] == ["from-a"]
            assert a.generation == 1 and b.generation == 2
    wake_a, wake_b = Wake.create(node), Wake.create(other_node)
    try:
        wake_a.post()
        assert wake_b.wait(0) is False
        assert wake_a.wait(0) is True
    finally:
        wake_a.close()
        wake_b.close()


def test_attach_to_a_missing_node_is_node_not_running(node):
    with pytest.raises(NodeNotRunning, match="does not exist"):
        ReadySet.attach(node)
    with pytest.raises(NodeNotRunning):
        StateBuffer.attach(node)
    with pytest.raises(NodeNotRunning):
        Wake.attach(node)
    with pytest.raises(NodeNotRunning, match="no node of that name"):
        read_state(node)


def test_another_layout_is_layout_mismatch_and_create_refuses_it(node):
    """A segment of this node's with another layout may hold what a crash
    left (live leases, in the lease table): refused with how to recover,
    never replaced behind the operator's back."""
    from shm.segment import StaleLayout

    name = shm_segment_name(node, "ready")
    segment.create(name, 4096, layout_version=99).close()
    with pytest.raises(LayoutMismatch, match="layout version 99"):
        ReadySet.attach(node)
    with pytest.raises(StaleLayout, match=f"stop it cleanly.*python -m node clear {node}"):
        ReadySet.create(node, capacity=10)
    assert segment.unlink(name)  # what clear does
    with ReadySet.create(node, capacity=10) as ready:
        assert not ready.segment.reattached
        ready.publish([("k", 1, 1, 1, 1.0)], 1.0)
    with ReadySet.attach(node) as ready:
        assert ready.snapshot().entries[0].key == "k"


def test_only_one_creator_and_a_half_made_segment_is_not_running(node):
    name = shm_segment_name(node, "ready")
    seg = segment.create(name, 4096, layout_version=1)
    with pytest.raises(NodeError, match="already exists"):
        segment.create(name, 4096, layout_version=1)
    seg.mm[0:4] = b"\0\0\0\0"  # as if the creator died before writing the magic
    seg.close()
    with pytest.raises(NodeNotRunning, match="not initialised"):
        ReadySet.attach(node)
    with ReadySet.create(node, capacity=10) as ready:
        assert not ready.segment.reattached


def test_foreign_bytes_are_layout_mismatch(node):
    name = shm_segment_name(node, "ready")
    seg = segment.create(name, 4096, layout_version=1)
    seg.mm[0:4] = b"NOPE"
    seg.close()
    with pytest.raises(LayoutMismatch, match="magic"):
        ReadySet.attach(node)


def test_the_supervisor_reattaches_after_a_crash_with_the_same_layout(node):
    ready = ReadySet.create(node, capacity=10)
    ready.publish([("survivor", 1, 1, 1, 1.0)], 1.0)
    ready.close()  # a crash: closed, never unlinked
    with ReadySet.create(node, capacity=10) as again:
        assert again.segment.reattached
        assert again.segment.owner_pid == os.getpid()
        assert [e.key for e in again.snapshot().entries] == ["survivor"]
        again.publish([("next", 1, 1, 1, 1.0)], 2.0)
        assert again.generation == 2
    with ReadySet.create(node, capacity=20) as resized:  # another size: start over
        assert not resized.segment.reattached
        assert resized.snapshot() == (0, 0.0, [])


def test_a_child_that_attaches_and_exits_unlinks_nothing(node):
    with ReadySet.create(node, capacity=10) as ready:
        ready.publish([("kept", 1, 1, 1, 1.0)], 1.0)
        state = StateBuffer.create(node, started_at=1.0)
        # A separate program, as the keeper or an autoscaler is: with
        # multiprocessing.shared_memory its resource tracker would unlink
        # both segments when it exits.
        out = _run_child(
            f"""
            import sys
            from shm.ready import ReadySet
            from shm.state import StateBuffer
            ready = ReadySet.attach({node!r})
            state = StateBuffer.attach({node!r})
            print(ready.snapshot().entries[0].key, state.read()["status"])
            assert "multiprocessing.resource_tracker" not in sys.modules
            ready.publish([("from-child", 2, 2, 2, 2.0)], 2.0)
            ready.close()
            # state is left open on purpose: exiting must not unlink it either
            """
        )
        assert out.stdout.split() == ["kept", "none"]
        assert _shm_path(node, "ready").exists() and _shm_path(node, "state").exists()
        assert [e.key for e in ready.snapshot().entries] == ["from-child"]
        assert ready.generation == 2
        with ReadySet.attach(node) as again:
            assert again.generation == 2
        assert state.read()["status"] == "none"
        state.close()


# -- the wake semaphore -------------------------------------------------------


def test_wake_post_is_capped_and_never_blocks(node):
    with Wake.create(node) as wake:
        for _ in range(100):
            wake.post()
        assert wake.sem.value == WAKE_CAP
        assert wake.drain() == WAKE_CAP
        assert wake.wait(0) is False
        assert wake.wait(0.01) is False
    with Wake.create(node) as again:  # left behind: reused, drained
        again.post()
    with Wake.create(node) as third:
        assert third.drain() == 0


@pytest.mark.timeout(30)
def test_wake_post_wakes_the_waiting_keeper(node):
    with Wake.create(node) as wake:
        proc, conn = _start(_block_then_report, node, "wake", 0)
        try:
            assert _recv(conn, "the child to start waiting") == "waiting"
            wait_until(lambda: _in_futex(proc.pid), "the child to block in sem_timedwait")
            wake.post()
            posted, waited_s = _recv(conn, "the woken child", 5.0)
        finally:
            proc.join(DEADLINE_S)
        assert posted is True
        assert waited_s < 5.0


# -- the state buffer ---------------------------------------------------------


def _live(state: StateBuffer, now: float, doc: dict | None = None) -> None:
    state.heartbeat(now, "live", True, "serving", published=True)
    state.write_doc(doc if doc is not None else {"now": {"in_flight": 0}}, now)


def test_state_read_round_trip(node):
    with StateBuffer.create(node, started_at=100.0) as state:
        first = state.read()
        assert first["status"] == "none" and first["exact"] is False
        assert first["started_at"] == 100.0 and first["first_publish_at"] == 0.0
        assert first["doc"] == {} and first["counts_at"] == 0.0
        state.heartbeat(101.0, "loading", False, "walking 10 rows")
        state.heartbeat(102.0, "live", True, None, published=True)
        state.heartbeat(103.0, "live", True, None, published=True)
        state.write_doc({"now": {"due": {"total": 3}}, "flow": [1, 2]}, 103.5)
        got = state.read()
        assert got["status"] == "live" and got["exact"] is True and got["phase"] is None
        assert got["heartbeat_at"] == 103.0 and got["published_at"] == 103.0
        assert got["first_publish_at"] == 102.0 and got["generation"] == 2
        assert got["counts_at"] == 103.5
        assert got["doc"] == {"now": {"due": {"total": 3}}, "flow": [1, 2]}
        assert got["writer_pid"] == got["owner_pid"] == os.getpid()
        state.heartbeat(104.0, "verifying", True, "é" * 40)
        assert state.read()["phase"] == "é" * 16  # 32 bytes, cut on a character


def test_state_document_too_large_names_the_sizes(node):
    with StateBuffer.create(node, size=8192, started_at=1.0) as state:
        with pytest.raises(ValueError, match=r"is \d+ bytes; a slot of this 8192-byte buffer"):
            state.write_doc({"blob": "x" * 10_000}, 1.0)
        state.write_doc({"small": 1}, 2.0)
        assert state.read()["doc"] == {"small": 1}
    with pytest.raises(ValueError, match="status"):
        with StateBuffer.attach(node) as state:
            state.heartbeat(1.0, "running", True)


def test_state_reattach_keeps_the_document_and_starts_the_header_over(node):
    state = StateBuffer.create(node, started_at=1.0)
    _live(state, 2.0, {"now": {"in_flight": 7}})
    state.close()
    with StateBuffer.create(node, started_at=50.0) as again:
        got = again.read()
        assert again.segment.reattached
        assert got["doc"] == {"now": {"in_flight": 7}} and got["counts_at"] == 2.0
        assert got["status"] == "none" and got["started_at"] == 50.0
        assert got["first_publish_at"] == 0.0


@pytest.mark.timeout(30)
def test_a_status_change_wakes_a_read_only_waiter(node):
    with StateBuffer.create(node, started_at=1.0) as state:
        gen = state.status_gen
        proc, conn = _start(_block_then_report, node, "state", gen)
        try:
            assert _recv(conn, "the child to start waiting") == "waiting"
            wait_until(lambda: _in_futex(proc.pid), "the child to block in futex(2)")
            state.heartbeat(2.0, "loading", False, "walking")
            state.heartbeat(3.0, "loading", False, "still walking")  # no change: no bump
            new_gen, waited_s = _recv(conn, "the woken child", 5.0)
        finally:
            proc.join(DEADLINE_S)
        assert new_gen == gen + 1 == state.status_gen
        assert waited_s < 5.0


def test_read_state_vouches_for_a_live_exact_fresh_keeper(node):
    with StateBuffer.create(node, started_at=1.0) as state:
        doc = {
            "now": {"due": {"sitemap": 1, "discovered": 2, "total": 3}, "in_flight": 4},
            "coming": {"15m": 5},
            "lateness": {"r": 0.5},
            "trust": {"lag_s": 0.2, "vouched": "the doc cannot override this"},
            "extra": {"kept": True},
        }
        _live(state, 1000.0, doc)
        got = read_state(node, now=1001.0)
    assert got["trust"]["vouched"] is True and got["trust"]["reason"] is None
    assert got["trust"]["live"] is True
    assert got["trust"]["lag_s"] == 0.2
    assert got["trust"]["heartbeat_age_s"] == 1.0 and got["trust"]["state_age_s"] == 1.0
    assert got["trust"]["status"] == "live" and got["trust"]["phase"] == "serving"
    assert got["now"] == {
        **doc["now"], "at": 1000.0, "in_flight": None, "held": None, "parked": None,
        "unclaimed": None, "paused": {"node": False, "routes": []}, "status": "live",
    }  # fmt: skip
    assert got["coming"] == {"15m": 5} and got["lateness"] == {"r": 0.5}
    assert got["flow"] is None
    assert got["extra"] == {"kept": True}


@pytest.mark.parametrize(
    ("setup", "read_at", "reason"),
    [
        ("stalled", 1007.2, "keeper stalled: heartbeat 7.2 s old"),
        ("stale_counts", 1016.0, "counts stale: 16.0 s old"),
        ("loading", 1001.0, "loading"),
        ("not_exact", 1001.0, "not exact: the keeper's copy is not caught up"),
        ("never_started", 1001.0, "keeper has not started"),
        ("no_counts", 1001.0, "counts stale: none written yet"),
    ],
)
def test_read_state_names_the_first_failed_check(node, setup, read_at, reason):
    with StateBuffer.create(node, started_at=1.0) as state:
        if setup in ("stalled", "stale_counts"):
            _live(state, 1000.0)
        if setup == "stale_counts":
            state.heartbeat(1015.0, "live", True, published=True)
        if setup == "loading":
            state.heartbeat(1000.0, "loading", False, "walking 5 rows")
        if setup == "not_exact":
            state.heartbeat(1000.0, "verifying", False)
            state.write_doc({}, 1000.0)
        if setup == "no_counts":
            state.heartbeat(1000.0, "live", True, published=True)
        got = read_state(node, now=read_at)
    assert got["trust"]["vouched"] is False
    assert got["trust"]["reason"] == reason
    assert got["trust"]["live"] is (setup != "stalled" and setup != "never_started")
    assert HEARTBEAT_MAX_AGE_S == 5.0


def test_read_state_when_the_keeper_process_is_gone(node):
    with StateBuffer.create(node, started_at=1.0):
        now = time.time()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from shm.state import StateBuffer\n"
                f"s = StateBuffer.attach({node!r})\n"
                f"s.heartbeat({now!r}, 'live', True, published=True)\n"
                f"s.write_doc({{'now': {{'in_flight': 1}}}}, {now!r})\n",
            ],
            cwd=ROOT,
        )
        assert proc.wait(DEADLINE_S) == 0
        got = read_state(node, now=now + 1.0)
    assert got["trust"]["vouched"] is False
    assert got["trust"]["reason"] == f"keeper process {proc.pid} is not alive (last status live)"
    assert got["trust"]["live"] is False
    # No counts when the keeper cannot vouch; no lease table here: in_flight null.
    assert set(got) == {"trust", "now"}
    paused = {"node": False, "routes": []}
    assert got["now"] == {"in_flight": None, "paused": paused, "status": "live"}


@pytest.mark.timeout(60)
def test_a_restarted_keeper_does_not_vouch_for_its_predecessors_document(node):
    """kill -9 of the keeper, its successor live, exact and heartbeating
    before it has counted: the document in the buffer is the dead keeper's,
    and neither /queue-state's builder nor ``python -m node state`` (exit 3,
    not 0) vouches for it; the successor's own exact document is vouched."""
    with StateBuffer.create(node, started_at=1.0) as state:
        now = time.time()
        old = subprocess.Popen(
            [sys.executable, "-c",
             f"import os, signal\n"
             f"from shm.state import StateBuffer\n"
             f"s = StateBuffer.attach({node!r})\n"
             f"s.heartbeat({now!r}, 'live', True, published=True)\n"
             f"s.write_doc({{'now': {{'in_flight': 1}}}}, {now!r})\n"
             f"os.kill(os.getpid(), signal.SIGKILL)\n"],
            cwd=ROOT,
        )  # fmt: skip
        assert old.wait(DEADLINE_S) == -signal.SIGKILL
        # The successor (this process): loaded, exact, publishing.
        state.heartbeat(time.time(), "live", True, "serving", published=True)
        got = read_state(node)
        assert got["trust"]["vouched"] is False, got["trust"]
        assert got["trust"]["reason"] == (
            f"counts stale: written by keeper process {old.pid}, not {os.getpid()}"
        )
        cli = [sys.executable, "-m", "node", "state", "--name", node]

        def state_cli() -> int:
            return subprocess.run(cli, cwd=ROOT, capture_output=True, timeout=DEADLINE_S).returncode

        assert state_cli() == 3
        state.write_doc({"now": {"in_flight": 2}}, time.time())
        assert read_state(node)["trust"]["vouched"] is True
        assert state_cli() == 0


def test_counts_taken_before_the_copy_was_exact_are_not_vouched_for(node):
    """A keeper writes its document while it loads; once live and exact it
    vouches only after it has counted again."""
    with StateBuffer.create(node, started_at=1.0) as state:
        state.heartbeat(1000.0, "loading", False, "walking 5 rows")
        state.write_doc({"now": {"in_flight": 0}}, 1000.0)
        state.heartbeat(1000.5, "live", True, "serving", published=True)
        got = read_state(node, now=1001.0)
        assert got["trust"]["reason"] == "counts stale: taken before the keeper's copy was exact"
        state.write_doc({"now": {"in_flight": 0}}, 1000.6)
        assert read_state(node, now=1001.0)["trust"]["vouched"] is True
        assert state.read()["doc"] == {"now": {"in_flight": 0}}  # the signature is not in it
        assert state.read()["counts_writer"] == {"pid": os.getpid(), "exact": True}


def test_read_state_when_the_supervisor_is_gone_is_node_not_running(node):
    _run_child(
        f"""
        from shm.state import StateBuffer
        StateBuffer.create({node!r}, started_at=1.0)  # then "crash": never unlinked
        """
    )
    assert _shm_path(node, "state").exists()
    with pytest.raises(NodeNotRunning, match=r"supervisor \(pid \d+\) is gone"):
        read_state(node)


def test_pid_alive_sees_through_zombies():
    assert pid_alive(os.getpid())
    assert not pid_alive(0)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    assert not pid_alive(proc.pid)
    proc.wait()
    assert not pid_alive(proc.pid)
