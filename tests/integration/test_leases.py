"""The lease table between real processes: exclusivity, dying holders, holds,
parking, a full table, saving and reattaching.

Children are real processes (multiprocessing's 'spawn' context, or a separate
interpreter through subprocess when a child needs the test hook's environment).
Nothing sleeps to synchronise: a test waits for a child's state, or polls a
condition up to a deadline. Table time is passed in (``now``); only the
contention test runs on the wall clock, because its leases really expire.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import time
import uuid
from array import array
from collections import defaultdict
from pathlib import Path

import msgpack
import pytest

from node.core.errors import NodeError
from node.core.names import shm_segment_name
from shm import leases, segment
from shm.leases import (
    AtomicsMissing,
    Lease,
    LeaseTable,
    Outcome,
    Refuse,
    Refused,
    hold_s,
)
from shm.ready import RECORD_TAG_MASK, RECORD_TAG_SHIFT
from tests.procs import proc_state, wait_until

SPAWN = multiprocessing.get_context("spawn")
ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 20.0
T0 = 1_700_000_000.0
LATER = T0 + 1e6  # every hold in these tests has passed


@pytest.fixture
def node():
    name = f"t{uuid.uuid4().hex[:12]}"
    yield name
    segment.unlink(shm_segment_name(name, "leases"))


@pytest.fixture
def table(node):
    t = LeaseTable.create(node, capacity=1024, max_misses=4)
    yield t
    t.close()






def _grant(t: LeaseTable, key: str, now: float, lease_s: float = 10.0, cadence_s: float = 3600.0):
    return t.grant(key, "tester", lease_s, now, cadence_s)


# -- one process ---------------------------------------------------------------


def test_a_granted_key_is_refused_until_its_lease_ends(table):
    lease = _grant(table, "k", T0)
    assert isinstance(lease, Lease) and lease.expires_at == T0 + 10
    again = _grant(table, "k", T0 + 1)
    assert again == Refused(Refuse.LEASED) and not again
    assert table.complete("k", lease.lease_id, T0 + 2) is Outcome.COMPLETED
    second = _grant(table, "k", T0 + 3)
    assert second and second.lease_id > lease.lease_id and second.misses == 0


def test_completion_outcomes(table):
    first = _grant(table, "k", T0)
    assert table.complete("k", first.lease_id, T0 + 1) is Outcome.COMPLETED
    assert table.complete("k", first.lease_id, T0 + 2) is Outcome.REPEAT
    second = _grant(table, "k", T0 + 3)
    assert table.complete("k", first.lease_id, T0 + 4) is Outcome.SUPERSEDED
    assert table.complete("k", second.lease_id + 1000, T0 + 4) is Outcome.UNKNOWN
    assert table.complete("other", second.lease_id, T0 + 4) is Outcome.UNKNOWN
    # Expired and swept, not granted since: the result is still accepted and
    # clears the miss.
    [expired] = table.expire(T0 + 100)
    assert expired.lease_id == second.lease_id and expired.misses == 1
    assert table.complete("k", second.lease_id, T0 + 101) is Outcome.LATE
    assert table.held() == []
    third = _grant(table, "k", T0 + 102)
    assert third and third.misses == 0


def test_lifetime_counters_balance_each_lease_ending_once(table):
    """routed = completed + (expired - late_expired) + (released - late_released) + live."""
    a = table.grant("a", "t", 10, T0, 3600, version=7)
    assert a.version == 7 and a.cadence_s == 3600
    b = table.grant("b", "t", 10, T0, 3600)
    c = table.grant("c", "t", 10, T0, 3600)
    table.grant("d", "t", 10, T0, 3600)
    assert table.complete("a", a.lease_id, T0 + 1) is Outcome.COMPLETED
    assert table.release("b", b.lease_id, T0 + 1, "boom") is Outcome.RELEASED
    assert {e.key for e in table.expire(T0 + 11)} == {"c", "d"}
    assert table.complete("c", c.lease_id, T0 + 12) is Outcome.LATE
    assert table.complete("b", b.lease_id, T0 + 12) is Outcome.LATE
    n = table.counters()
    assert n == {"grants": 4, "released": 1, "expired": 2, "completed": 1,
                 "late_expired": 1, "late_released": 1, "refused_full": 0}
    finished = n["completed"] + n["late_expired"] + n["late_released"]
    expired = n["expired"] - n["late_expired"]
    released = n["released"] - n["late_released"]
    assert n["grants"] == finished + expired + released + table.live_count()


def test_peek_says_what_complete_would_and_changes_nothing(table):
    lease = table.grant("k", "t", 10, T0, 600, version=42)
    outcome, seen = table.peek("k", lease.lease_id)
    assert outcome is Outcome.COMPLETED and seen.version == 42 and seen.cadence_s == 600
    assert table.peek("k", lease.lease_id + 5)[0] is Outcome.UNKNOWN
    assert table.live_count() == 1
    table.expire(T0 + 11)
    assert table.peek("k", lease.lease_id)[0] is Outcome.LATE
    again = table.grant("k", "t", 10, LATER, 600)
    assert table.peek("k", lease.lease_id)[0] is Outcome.SUPERSEDED
    assert table.complete("k", again.lease_id, LATER + 1) is Outcome.COMPLETED
    assert table.peek("k", again.lease_id)[0] is Outcome.REPEAT


def test_lookup_names_a_keys_state_and_record_and_changes_nothing(table):
    assert table.lookup("nobody") is None
    lease = _grant(table, "k", T0)
    state, rec = table.lookup("k")
    assert state == "leased" and rec.lease_id == lease.lease_id
    assert rec.consumer_str == "tester" and rec.expires_at == lease.expires_at
    assert table.release("k", lease.lease_id, T0 + 1, error="boom") is Outcome.RELEASED
    state, rec = table.lookup("k")
    assert state == "held" and rec.misses == 1 and rec.error_str == "boom"
    assert table.lookup("k") == (state, rec)  # a read: nothing changed
    # What workers/claim/path.py's explain read through the private lookup before.
    kb = b"k"
    _idx, w, same = table._lookup(kb, leases._hash(kb))
    assert same == rec and leases.CODE_NAMES[w & 15] == state


def test_the_granter_is_the_c_grant_on_this_mapping(table):
    from shm import _claim

    assert table.granter is table._granter
    assert isinstance(table.granter, _claim.Granter)


def test_no_stop_is_bound_outside_a_test_that_asks_for_one():
    """Production pays nothing for the test stops: no stop function is
    bound to the Python paths, and the C paths get stop 0."""
    from shm.leases import test_stops

    assert os.environ.get("QUEUE_NODE_TEST_LEASE_STOP") is None
    assert test_stops.stop is None and leases.C_STOP == 0
    for method in (LeaseTable._take, LeaseTable._update, LeaseTable._insert):
        assert method.__defaults__[-1] is None, method
    assert LeaseTable._claim_free.__defaults__ == (None,)


def test_counters_survive_save_and_load(node, tmp_path):
    with LeaseTable.create(node, capacity=64) as t:
        lease = t.grant("k", "t", 10, T0, 3600, version=3)
        t.grant("j", "t", 10, T0, 3600)
        t.complete("j", t.live()[1].lease_id if t.live()[1].key == "j" else t.live()[0].lease_id,
                   T0 + 1)
        t.save(tmp_path / "leases.msgpack", T0 + 2)
        before = t.counters()
    LeaseTable.unlink(node)
    with LeaseTable.create(node, capacity=64) as t:
        assert t.load(tmp_path / "leases.msgpack") == 1
        assert t.counters() == before
        assert t.peek("k", lease.lease_id)[1].version == 3


def test_an_expired_lease_not_yet_swept_still_completes_and_is_never_swept(table):
    lease = _grant(table, "k", T0)
    assert _grant(table, "k", T0 + 50) == Refused(Refuse.LEASED)  # expired, unswept
    assert table.complete("k", lease.lease_id, T0 + 50) is Outcome.COMPLETED
    assert table.expire(T0 + 60) == []


def test_renew(table):
    lease = _grant(table, "k", T0)
    assert table.renew("k", lease.lease_id, 30, T0 + 5) is Outcome.RENEWED
    assert table.expire(T0 + 20) == []
    assert table.live()[0].expires_at == T0 + 35
    assert table.renew("k", lease.lease_id, 30, T0 + 36) is Outcome.ENDED  # past expiry
    assert table.renew("k", lease.lease_id + 1, 30, T0 + 5) is Outcome.UNKNOWN


def _hint(t: LeaseTable) -> float:
    return struct.unpack("<d", struct.pack("<Q", t._view.load64(leases.EARLIEST_EXPIRY)))[0]


@pytest.mark.parametrize("path", ["c", "python"])
def test_the_next_expiry_hint_follows_every_grant_and_renew(table, path):
    """A sweep that skips its scan (now below the hint) never skips an
    expiry: a grant or a shorter renew after a sweep lowers the hint."""
    if path == "python":
        table._granter = None
    elif table._granter is None:
        pytest.skip("shm._claim is not built")
    long = _grant(table, "long", T0, lease_s=600)
    assert table.expire(T0) == []  # scanned: the hint is long's expiry
    assert _hint(table) == T0 + 600
    short = _grant(table, "short", T0 + 1, lease_s=5)
    assert _hint(table) == T0 + 6
    assert [e.key for e in table.expire(T0 + 6)] == ["short"]
    assert _hint(table) == T0 + 600
    assert table.expire(T0 + 100) == []  # below the hint: nothing to do
    assert table.renew("long", long.lease_id, 2, T0 + 100) is Outcome.RENEWED
    assert _hint(table) == T0 + 102
    assert [e.key for e in table.expire(T0 + 102)] == ["long"]
    assert short.lease_id != long.lease_id


def test_a_lost_hint_costs_at_most_a_full_scan_interval(table):
    """A writer killed between publishing a lease and lowering the hint (the
    hint stays above that lease's expiry): the lease still expires, at the
    next full scan, within FULL_SCAN_S."""
    _grant(table, "k", T0, lease_s=5)
    assert table.expire(T0) == []
    table._view.store64(leases.EARLIEST_EXPIRY, struct.unpack("<Q", struct.pack("<d", T0 + 1e6))[0])
    swept: list = []
    wait_until(
        lambda: swept.extend(table.expire(T0 + 10)) or swept,
        "the full scan",
        deadline_s=leases.FULL_SCAN_S + 5,
    )
    assert [e.key for e in swept] == ["k"]


def test_hold_schedule_doubles_and_is_capped_at_the_cadence(table):
    lease_s, cadence_s = 10.0, 100.0
    now = T0
    expected = [20.0, 40.0, 80.0]
    for misses, hold in enumerate(expected, start=1):
        lease = table.grant("k", "c", lease_s, now, cadence_s)
        assert lease and lease.misses == misses - 1
        assert table.release("k", lease.lease_id, now, error=f"boom {misses}") is Outcome.RELEASED
        [held] = table.held()
        assert (held.misses, held.held_until, held.last_error) == (
            misses,
            now + hold,
            f"boom {misses}",
        )
        assert table.grant("k", "c", lease_s, now + hold - 0.001, cadence_s) == Refused(Refuse.HELD)
        assert table.is_excluded("k", now + hold - 0.001)
        assert not table.is_excluded("k", now + hold)
        now += hold
    assert hold_s(4, lease_s, cadence_s) == cadence_s
    assert hold_s(1000, lease_s, cadence_s) == cadence_s


def test_an_expiry_is_a_miss_and_parking_follows_max_misses(table):
    now = T0
    for misses in range(1, 5):  # the table's max_misses is 4
        lease = table.grant("k", "c", 10, now, 3600)
        assert lease, f"refused before miss {misses}: {lease}"
        [expired] = table.expire(now + 10)
        assert (expired.key, expired.lease_id, expired.misses) == ("k", lease.lease_id, misses)
        assert expired.parked == (misses == 4)
        now = expired.held_until
    assert table.grant("k", "c", 10, now + 1e6, 3600) == Refused(Refuse.PARKED)
    assert table.is_excluded("k", now + 1e6)
    [held] = table.held()
    assert held.parked and held.misses == 4
    assert table.unhold(["k", "never-seen"]) == 1
    assert table.held() == []
    lease = table.grant("k", "c", 10, now, 3600)
    assert lease and lease.misses == 0


def test_a_new_write_clears_misses_hold_and_parking(table):
    lease = _grant(table, "k", T0)
    table.release("k", lease.lease_id, T0)
    assert table.is_excluded("k", T0 + 1)
    assert table.clear_on_write("k") is True
    assert not table.is_excluded("k", T0 + 1)
    assert table.clear_on_write("k") is False  # nothing left to clear
    assert table.clear_on_write("no-such-key") is False
    assert _grant(table, "k", T0 + 1)


def test_a_late_results_pin_holds_an_ended_lease_until_its_end_or_the_pin(table):
    """``pin_late``: an expired or released lease (held, or cleared by a
    write) keeps its key from any grant until ``until`` or its late result;
    a live, parked, superseded or finished lease is left as it is."""
    first = _grant(table, "k", T0)
    assert table.pin_late("k", first.lease_id, T0 + 50) is False  # live: nothing to pin
    [expired] = table.expire(T0 + 10)  # held until T0 + 10 + 20
    assert table.pin_late("k", first.lease_id, T0 + 25) is True  # held longer already
    assert table.pin_late("k", first.lease_id, T0 + 50) is True
    assert _grant(table, "k", T0 + 40) == Refused(Refuse.HELD)
    assert table.complete("k", first.lease_id, T0 + 41) is Outcome.LATE
    assert table.lookup("k")[0] == "idle" and table.held() == []  # the end clears it
    assert table.pin_late("k", first.lease_id, T0 + 60) is False  # ended by its result
    second = _grant(table, "k", T0 + 42)
    table.release("k", second.lease_id, T0 + 42)
    assert table.clear_on_write("k")  # a write cleared its hold: grantable again
    assert table.pin_late("k", second.lease_id, T0 + 70) is True
    assert _grant(table, "k", T0 + 69) == Refused(Refuse.HELD)
    assert _grant(table, "k", T0 + 71)  # the pin passed: granted as usual
    assert table.pin_late("k", second.lease_id, T0 + 90) is False  # superseded


def test_excluded_keys_are_leased_held_and_parked_only(node):
    with LeaseTable.create(node, capacity=64, max_misses=2) as t:
        _grant(t, "leased", T0)
        for key, at in (("held", T0), ("hold-passed", T0 - 100)):
            lease = _grant(t, key, at)
            t.release(key, lease.lease_id, at)  # held for 20 s
        for at in (T0 - 1000, T0):
            lease = _grant(t, "parked", at)
            t.release("parked", lease.lease_id, at)
        done = _grant(t, "done", T0)
        t.complete("done", done.lease_id, T0)
        long_key = "ü" * 512  # 1,024 bytes, past the inline part
        _grant(t, long_key, T0)
        assert t.excluded_keys(T0 + 1) == {"leased", "held", "parked", long_key}
        for key in ("leased", "held", "parked", long_key):
            assert t.is_excluded(key, T0 + 1)
        for key in ("hold-passed", "done", "never-seen"):
            assert not t.is_excluded(key, T0 + 1)
        assert [(h.key, h.parked) for h in t.held()] == [
            ("parked", True),
            ("hold-passed", False),
            ("held", False),
        ]
        assert {lease.key for lease in t.live()} == {"leased", long_key}


def test_long_keys_are_kept_whole_and_compared_whole(node):
    with LeaseTable.create(node, capacity=64, long_blocks=2) as t:
        a, b = "a" * 1000 + "1", "a" * 1000 + "2"
        assert _grant(t, a, T0) and _grant(t, b, T0)
        assert _grant(t, a, T0) == Refused(Refuse.LEASED)
        # Both overflow blocks are taken: a third long key is refused as full.
        assert _grant(t, "c" * 300, T0) == Refused(Refuse.FULL)
        assert t.stats()["refused_full"] == 1
        assert _grant(t, "short", T0)
        with pytest.raises(ValueError):
            _grant(t, "x" * 1025, T0)
        with pytest.raises(ValueError):
            _grant(t, "", T0)


def test_a_full_table_refuses_and_counts(node):
    with LeaseTable.create(node, capacity=16) as t:
        got = [_grant(t, f"key-{i}", T0) for i in range(16)]
        assert all(got)
        assert _grant(t, "one-too-many", T0) == Refused(Refuse.FULL)
        assert _grant(t, "and-another", T0) == Refused(Refuse.FULL)
        assert t.stats()["refused_full"] == 2
        t.complete("key-7", got[7].lease_id, T0)
        assert _grant(t, "one-too-many", T0)


def test_low_occupancy_never_refuses(node):
    rnd = random.Random(7)
    with LeaseTable.create(node, capacity=4096) as t:
        fill = int(0.9 * 4096)
        for i in range(fill):
            assert _grant(t, f"resident-{i}", T0), f"refused at {i} of {fill}"
        for _ in range(2000):
            key = f"new-{rnd.getrandbits(64):x}"
            lease = _grant(t, key, T0)
            assert lease, f"refused {key} at 90% occupancy: {lease}"
            assert t.complete(key, lease.lease_id, T0) is Outcome.COMPLETED
        # Every last slot can be taken; only then is a grant refused.
        for i in range(4096 - fill):
            assert _grant(t, f"top-up-{i}", T0), f"refused with {4096 - fill - i} slots left"
        assert _grant(t, "one-too-many", T0) == Refused(Refuse.FULL)
        stats = t.stats()
        assert stats["refused_full"] == 1
        assert stats["slots"]["leased"] == 4096


def test_save_and_load_round_trip(node, tmp_path):
    path = tmp_path / "leases.msgpack"
    with LeaseTable.create(node, capacity=256, max_misses=2) as t:
        live = [_grant(t, f"live-{i}", T0) for i in range(5)]
        held = _grant(t, "held", T0)
        t.release("held", held.lease_id, T0, error="gpu fell over")
        first = _grant(t, "parked", T0)
        t.release("parked", first.lease_id, T0)
        second = _grant(t, "parked", T0 + 20)
        t.release("parked", second.lease_id, T0 + 20)  # the second miss: parked
        done = _grant(t, "done", T0)
        t.complete("done", done.lease_id, T0)  # idle: not saved
        before = (t.live(), t.held())
        assert [h.parked for h in before[1]] == [True, False]
        assert t.save(path, now=T0 + 30) == 7
    LeaseTable.unlink(node)
    with LeaseTable.create(node, capacity=256, max_misses=2) as t:
        assert not t.segment.reattached
        assert t.load(path) == 7
        assert (t.live(), t.held()) == before
        assert _grant(t, "live-0", T0) == Refused(Refuse.LEASED)
        assert _grant(t, "parked", T0 + 1e6) == Refused(Refuse.PARKED)
        assert t.complete("live-3", live[3].lease_id, T0 + 31) is Outcome.COMPLETED
        fresh = _grant(t, "brand-new", T0 + 31)
        assert fresh.lease_id > max(lease.lease_id for lease in live)
        assert t.load(path) == 0  # every key is there already: the table wins
    doc = msgpack.unpackb(path.read_bytes())
    assert doc["format"] == "queue-node.leases" and len(doc["entries"]) == 7


def test_a_file_that_is_not_a_lease_file_is_refused_by_name(table, tmp_path):
    for name, content in (
        ("garbage", b"\xc1\xc1 not msgpack"),
        ("foreign", msgpack.packb({"format": "something-else", "version": 1})),
        ("bad-entry", msgpack.packb({**_HEADER_DOC, "entries": [[b"k", 99, 1, 2]]})),
    ):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(NodeError, match=name):
            table.load(path)
    assert table.live() == []


_HEADER_DOC = {"format": "queue-node.leases", "version": 1, "next_lease_id": 5, "saved_at": 0}


def test_missing_extension_is_a_clear_error(node, monkeypatch):
    monkeypatch.setattr(leases.protocol, "_atomic", None)
    with pytest.raises(AtomicsMissing, match="pip install -e"):
        LeaseTable.create(node)
    assert not Path("/dev/shm", shm_segment_name(node, "leases").lstrip("/")).exists()


def test_the_atomics_check_offsets():
    import mmap

    from shm import _atomic

    mm = mmap.mmap(-1, 64)
    view = _atomic.View(mm)
    try:
        assert view.cas64(8, 0, 5) == 0 and view.load64(8) == 5
        assert view.cas64(8, 0, 7) == 5 and view.load64(8) == 5
        assert view.add64(8, 2) == 5 and view.load64(8) == 7
        assert view.max32(16, 9) == 0 and view.max32(16, 3) == 9 and view.load32(16) == 9
        for bad in (-8, 4, 64, 60):
            with pytest.raises(ValueError):
                view.load64(bad)
        with pytest.raises(ValueError):
            view.find_code(0, 9, 0, 9, 1)  # 72 bytes do not fit
        with pytest.raises(ValueError):
            view.scan_f64(0, 2, 1, 0, 32, 0, 32, 0.0, True)  # slot 1's field ends at 72
        # Two words (codes 5, the second on copy 1), then 16-byte slots from 16.
        words = (5, 5 | 1 << 8)
        struct.pack_into("<QQdddd", mm, 0, *words, 1.0, -1.0, -1.0, 9.0)
        assert view.scan_f64(0, 2, 1 << 5, 16, 16, 0, 8, 4.0, True) == [(1, words[1])]
        assert view.scan_f64(0, 2, 1 << 5, 16, 16, 0, 8, 4.0, False) == [(0, words[0])]
        assert view.scan_f64(0, 2, 1 << 4, 16, 16, 0, 8, 4.0, False) == []
    finally:
        view.release()
        mm.close()


def test_the_excluded_keys_scan_reads_the_layout_it_is_given():
    import mmap

    from shm import _atomic

    mm = mmap.mmap(-1, 1024)
    view = _atomic.View(mm)
    # Two words at 0; 128-byte slots from 64 (key_len at +0, block at +4, 16
    # inline key bytes at +16, held_until at +40 / +48); 32-byte blocks from 512.
    layout = (0, 2, 64, 128, 16, 16, 40, 48, 512, 32, 2)
    leased, held = 5, 6
    masks = (1 << leased, 1 << held, 2)
    try:
        struct.pack_into("<QQ", mm, 0, leased, held | 1 << 8)  # slot 1 on copy 1
        struct.pack_into("<HHI", mm, 64, 5, 0, 0)
        mm[64 + 16 : 64 + 21] = b"hello"
        struct.pack_into("<HHI", mm, 192, 19, 0, 2)  # 16 bytes inline, 3 in block 2
        mm[192 + 16 : 192 + 32] = "abcdefghijklmnö".encode()
        struct.pack_into("<dd", mm, 192 + 40, 99.0, 9.0)
        mm[512 + 32 : 512 + 35] = b"rst"
        got = view.excluded_keys(*layout, 4.0, *masks, None)
        assert got == ({"hello", "abcdefghijklmnörst"}, [])
        assert view.excluded_keys(*layout, 9.0, *masks, None) == ({"hello"}, [])
        # A key whose block is out of range, under a steady word: the caller's.
        struct.pack_into("<I", mm, 192 + 4, 3)
        assert view.excluded_keys(*layout, 4.0, *masks, None) == ({"hello"}, [1])
        struct.pack_into("<H", mm, 64, 0)  # no key at all
        assert view.excluded_keys(*layout, 9.0, *masks, [None, None]) == (set(), [0])
        bad = [
            (0, 2, 64, 128, 16, 16, 40, 48, 512, 32, 17),  # 17 blocks end past 1,024
            (0, 8, 64, 128, 16, 16, 40, 48, 512, 32, 2),  # 8 slots end past 1,024
            (0, 2, 64, 128, 16, 120, 40, 48, 512, 32, 2),  # the key runs past the slot
            (0, 2, 64, 128, 16, 16, 40, 124, 512, 32, 2),  # so does held_until
            (4, 2, 64, 128, 16, 16, 40, 48, 512, 32, 2),  # misaligned words
        ]
        for args in bad:
            with pytest.raises(ValueError):
                view.excluded_keys(*args, 4.0, *masks, None)
        with pytest.raises(ValueError):
            view.excluded_keys(*layout, 4.0, *masks, [None])  # a cache of the wrong size
        with pytest.raises(TypeError):
            view.excluded_keys(*layout, 4.0, *masks, [b"not a str", None])
    finally:
        view.release()
        mm.close()


# -- excluded_keys: the C scan against the Python one ------------------------------


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _leave_updating(t: LeaseTable, key: str, pid: int) -> bool:
    """Leave the key's slot UPDATING under ``pid``, as a process killed in the
    middle of changing it does; whether it had a settled slot."""
    kb = key.encode()
    found = t._lookup(kb, leases._hash(kb))
    if found is None or found[1] & 15 == leases.UPDATING:
        return False
    idx, w, _ = found
    tag = ((w >> 31) + 1) & leases.TAG_MASK  # any tag: the pid is gone
    own = leases._next(w, leases.UPDATING, leases._copy(w), prev=w & 15, owner=pid << 9 | tag << 31)
    return t._view.cas64(leases.STATES + 8 * idx, w, own) == w


def _random_key(rnd: random.Random) -> str:
    shape = rnd.random()
    tail = f"{rnd.getrandbits(24):x}"
    if shape < 0.5:
        return f"https://example.com/items/{tail}"
    if shape < 0.65:
        return f"ключ/{tail}/ü→✓"
    if shape < 0.8:  # around the end of the inline part
        return "i" * rnd.choice((203, 204, 205, 206, 207, 208)) + tail[:4].rjust(4, "0")
    # long: the same long head, told apart only in the overflow block
    head = "h" * 200 + "ü" * rnd.randrange(0, 100)
    return (head + "/" + tail * rnd.randrange(1, 60))[:1000]


@pytest.mark.parametrize("seed", range(5))
def test_excluded_keys_in_c_agree_with_the_python_scan(node, seed):
    rnd = random.Random(seed)
    dead = _dead_pid()
    seen: dict[str, int] = defaultdict(int)
    followed: set[str] = set()  # kept by excluded_changes alone, as the keeper does
    with LeaseTable.create(node, capacity=256, long_blocks=24, max_misses=3) as t, \
            LeaseTable.attach(node) as follower:
        keys = list({_random_key(rnd) for _ in range(420)})  # more keys than slots
        for step in range(10):
            for _ in range(250):
                key = rnd.choice(keys)
                at = T0 + rnd.uniform(-60, 60)
                lease = _grant(t, key, at, rnd.choice((0.5, 5.0)), rnd.choice((8.0, 200.0)))
                if not lease:
                    continue
                action = rnd.random()
                if action < 0.35:
                    t.complete(key, lease.lease_id, at)
                elif action < 0.75:
                    t.release(key, lease.lease_id, at)  # held, maybe parked
            if step % 3 == 2:
                t.expire(T0 + rnd.uniform(-60, 60))  # misses; rolls back the dead's slots
            for key in rnd.sample(keys, 4):
                _leave_updating(t, key, dead)
            for name, n in t.stats()["slots"].items():
                seen[name] += n
            reader = LeaseTable.attach(node)  # a cold cache next to the warm one
            try:
                for now in (T0 - 1000, T0 - 20, T0, T0 + 7.5, T0 + 80, LATER):
                    want = t._excluded_keys_py(now)
                    assert t.excluded_keys(now) == want, (step, now)
                    assert reader.excluded_keys(now) == want, (step, now)
                    _follow(follower, followed, now)
                    assert followed == want, (step, now)
                    assert set(follower.excluded) == want, (step, now)  # kept in step
                    assert all(follower.excluded_slots(k) >= 1 for k in want)
            finally:
                reader.close()
        long_keys = {k for k in t.excluded_keys(T0 - 1000) if len(k.encode()) > 208}
    for state in ("idle", "leased", "held", "parked", "updating"):
        assert seen[state], f"no {state} slot in the random tables: {dict(seen)}"
    assert long_keys, "no long key was excluded"


def _grant_records(t: LeaseTable, keys: list[str], tag: int, rnd: random.Random) -> array:
    """Grant records for ``keys`` as the C claim path writes them (shm/ready/layout.py)
    for the slot each key is in now, leased or not, and among them records a
    scan must pass over: another publish's tag, a seq the slot never had,
    none, nonsense."""
    out = array("Q")
    for key in keys:
        kb = key.encode()
        found = t._lookup(kb, leases._hash(kb))
        kind = rnd.random()
        if found is None or kind < 0.05:
            untagged = ~(RECORD_TAG_MASK << RECORD_TAG_SHIFT)
            out.append(0 if kind < 0.5 else rnd.getrandbits(64) & untagged)
            continue
        idx, w, _rec = found
        seq = (w >> leases.SEQ_SHIFT) & leases.SEQ_MASK
        if kind < 0.15:
            seq = (seq + 1) & leases.SEQ_MASK  # a word the slot has not had yet
        rec = (idx + 1) | ((w >> 8) & 1) << 23 | seq << 24
        tagged = (tag + 1) & RECORD_TAG_MASK if kind < 0.25 else tag
        out.append(rec | tagged << RECORD_TAG_SHIFT)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_excluded_changes_with_grant_records_find_what_a_scan_finds(node, seed):
    """The keeper's scan given grant records (the C claim path's hints)
    settles the slots they vouch for with the keeper's own strs, and ends
    where a scan without them ends, whatever the records say."""
    rnd = random.Random(seed)
    hinted_from_list = 0
    with LeaseTable.create(node, capacity=256, long_blocks=24, max_misses=3) as t, \
            LeaseTable.attach(node) as plain, LeaseTable.attach(node) as hinted:
        keys = list({_random_key(rnd) for _ in range(300)})
        followed_plain: set[str] = set()
        followed_hinted: set[str] = set()
        for step in range(12):
            for _ in range(150):
                key = rnd.choice(keys)
                at = T0 + rnd.uniform(-60, 60)
                lease = _grant(t, key, at, rnd.choice((0.5, 5.0)), rnd.choice((8.0, 200.0)))
                if lease and rnd.random() < 0.3:
                    t.complete(key, lease.lease_id, at)
                elif lease and rnd.random() < 0.3:
                    t.release(key, lease.lease_id, at)
            if step % 4 == 3:
                t.expire(T0 + rnd.uniform(-60, 60))
            # Two published sets (the active one and the one before), as the
            # keeper passes them; a key may be in both.
            hints = []
            mine = set()
            for _ in range(2):
                published = [
                    (k + "x")[:-1] if rnd.random() < 0.5 else k for k in rnd.sample(keys, 120)
                ]
                tag = rnd.getrandbits(20)
                records = _grant_records(t, published, tag, rnd)
                hints.append((records, published, len(published), tag))
                mine |= {id(k) for k in published}
            now = rnd.choice((T0 - 20, T0, T0 + 80))
            want = t._excluded_keys_py(now)
            added, removed = hinted.excluded_changes(now, hints)
            hinted_from_list += sum(id(k) in mine for k in added)
            followed_hinted.difference_update(set(removed).difference(added))
            followed_hinted.update(added)
            _follow(plain, followed_plain, now)
            assert followed_hinted == followed_plain == want, step
            assert set(hinted.excluded) == set(plain.excluded) == want, step
    assert hinted_from_list, "no key was settled from the records"


def _follow(table: LeaseTable, followed: set[str], now: float) -> None:
    """Apply ``excluded_changes`` to ``followed`` the way the keeper does."""
    added, removed = table.excluded_changes(now)
    followed.difference_update(set(removed).difference(added))
    followed.update(added)


def test_excluded_changes_report_only_what_changed(node):
    with LeaseTable.create(node, capacity=64, max_misses=3) as t:
        leases = {k: _grant(t, k, T0, lease_s=60) for k in ("a", "b", "c")}
        assert sorted(t.excluded_changes(T0)[0]) == ["a", "b", "c"]
        assert t.excluded_changes(T0) == ([], [])  # nothing moved: nothing said
        t.complete("a", leases["a"].lease_id, T0)
        t.release("b", leases["b"].lease_id, T0, error="x")  # held for a while
        assert t.excluded_changes(T0) == ([], ["a"])
        assert t.excluded_changes(LATER) == ([], ["b"])  # the hold ran out
        assert t.excluded_changes(T0) == (["b"], [])  # (and back, at an earlier now)
        _grant(t, "d", T0, lease_s=60)
        assert t.excluded_changes(T0) == (["d"], [])


def test_a_key_keyed_twice_for_a_moment_stays_followed(node):
    """Two inserts of one key race: for a moment the key is keyed in two
    slots, and the one that backs off frees its slot. That slot's change must
    not report the key removed while its other slot still holds it leased
    (the keeper would put a leased key back in its orders; the churn test
    below caught it once in CI)."""
    with LeaseTable.create(node, capacity=64) as t, LeaseTable.attach(node) as follower:
        assert _grant(t, "k", T0, lease_s=60)
        followed: set[str] = set()
        _follow(follower, followed, T0)
        assert followed == {"k"}
        # The losing insert, caught keyed (as LeaseTable._insert leaves it).
        kb = b"k"
        h64 = leases._hash(kb)
        idx, w, own = t._claim_free(h64 & t._cap_mask)
        assert t._write_key(idx, w, kb, h64)
        keyed = leases._next(own, leases.UPDATING, leases._copy(own), prev=leases.FREE,
                             owner=leases.owner_bits())
        assert t._cas(idx, own, keyed)
        assert follower.excluded_changes(T0) == ([], [])  # out already: not added again
        assert follower.excluded == {"k"} and follower.excluded_slots("k") == 2
        t._rollback(idx, keyed)  # it backs off: FREE again
        assert follower.excluded_changes(T0) == ([], [])  # neither way: still out
        assert followed == {"k"} == t._excluded_keys_py(T0) == set(follower.excluded)


def test_excluded_keys_gives_its_strings_again_only_for_the_same_bytes(node):
    with LeaseTable.create(node, capacity=16, long_blocks=4) as t:
        keys = [f"k{i:02d}" for i in range(12)] + ["ü1", "ü2", "x" * 300 + "1", "x" * 300 + "2"]
        got = {key: _grant(t, key, T0) for key in keys}  # every slot taken
        first = t.excluded_keys(T0)
        assert first == set(keys)
        again = t.excluded_keys(T0)
        same = {key: key for key in first}
        assert all(key is same[key] for key in again), "a cached key was decoded again"
        # Each of these slots gets a new key of the same length between two calls.
        swaps = {"k03": "q03", "ü1": "ü3", "x" * 300 + "1": "x" * 300 + "3"}
        for old, new in swaps.items():
            t.complete(old, got[old].lease_id, T0)
            assert _grant(t, new, T0)  # the only reusable slot: the old key's
        want = set(keys) - set(swaps) | set(swaps.values())
        assert t.excluded_keys(T0) == want == t._excluded_keys_py(T0)
        # Keys no longer excluded leave the cache.
        t.complete("k05", got["k05"].lease_id, T0)
        t.release("k06", got["k06"].lease_id, T0)  # held until T0 + 20
        assert t.excluded_keys(T0 + 20) == want - {"k05", "k06"}
        assert sum(item is not None for item in t._key_cache) == len(want) - 2
        assert t.excluded_keys(T0 + 19) == want - {"k05"} == t._excluded_keys_py(T0 + 19)


def test_excluded_keys_leaves_a_key_it_cannot_read_to_the_slot_by_slot_reader(node):
    with LeaseTable.create(node, capacity=16, long_blocks=2) as t:
        for key in ("a", "b", "c" * 300):
            _grant(t, key, T0)
        for key, field, value in (("a", 0, 0), ("c" * 300, 4, 0)):  # key_len 0; no block
            kb = key.encode()
            idx = t._lookup(kb, leases._hash(kb))[0]
            struct.pack_into("<H" if field == 0 else "<I", t.mm, t._slot(idx) + field, value)
        assert t.excluded_keys(T0) == {"b"} == t._excluded_keys_py(T0)


# -- many processes --------------------------------------------------------------


def _claimer(node: str, seed: int, grants: int, keys: int, log_path: str) -> None:
    """Grant random keys on the wall clock; end each lease by completing,
    releasing or abandoning it; sweep now and then. Logs every lease it got
    and every expiry its sweeps counted, with monotonic nanoseconds taken
    inside the real holding period (after the grant, before the end)."""
    rnd = random.Random(seed)
    table = LeaseTable.attach(node)
    held_log, swept_log = [], []
    me = f"claimer-{seed}"
    got = attempts = 0
    deadline = time.monotonic() + 120
    while got < grants and time.monotonic() < deadline:
        attempts += 1
        if attempts % 16 == 0:
            started = time.monotonic_ns()
            for exp in table.expire(time.time()):
                swept_log.append((exp.key, exp.lease_id, started))
        key = f"key-{rnd.randrange(keys)}"
        lease = table.grant(key, me, 0.004, time.time(), 0.008)
        if not lease:
            continue
        got += 1
        start = time.monotonic_ns()
        action = rnd.random()
        if action < 0.2:
            held_log.append((key, lease.lease_id, start, None, "abandoned"))
            continue
        end = time.monotonic_ns()
        if action < 0.8:
            outcome = table.complete(key, lease.lease_id, time.time())
        else:
            outcome = table.release(key, lease.lease_id, time.time(), error="no")
        held_log.append((key, lease.lease_id, start, end, outcome.value))
    table.close()
    with open(log_path, "wb") as f:
        f.write(msgpack.packb({"held": held_log, "swept": swept_log, "got": got}))


def _exclusive_claims(node: str, tmp_path: Path, procs: int, grants: int) -> None:
    with LeaseTable.create(node, capacity=64, max_misses=1000) as table:
        paths = [tmp_path / f"claimer-{i}.msgpack" for i in range(procs)]
        children = [
            SPAWN.Process(target=_claimer, args=(node, i, grants, 48, str(path)))
            for i, path in enumerate(paths)
        ]
        for child in children:
            child.start()
        for child in children:
            child.join(timeout=300)
        for child in children:
            assert child.exitcode == 0, f"claimer exited {child.exitcode}"
        final_sweep = time.monotonic_ns()
        leftover = table.expire(time.time() + 3600)
        stats = table.stats()
    docs = [msgpack.unpackb(path.read_bytes()) for path in paths]
    total = sum(doc["got"] for doc in docs)
    assert total == procs * grants
    assert stats["grants"] == total
    starts, ends = _lease_spans(docs, [(exp.lease_id, final_sweep) for exp in leftover])
    # Every lease ended exactly once: by its holder, or by one sweep.
    assert set(ends) == set(starts)
    assert all(len(ends[lease_id]) == 1 for lease_id in starts), "a lease ended twice"
    # Each span lies inside its lease's real holding period. A holder that was
    # descheduled past its lease's expiry and sweep logs its start after the
    # sweep's: such an empty span says nothing and is left out.
    by_key: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for lease_id, (key, start) in starts.items():
        if start < ends[lease_id][0]:
            by_key[key].append((start, ends[lease_id][0], lease_id))
    spans = sum(map(len, by_key.values()))
    assert spans > 0.6 * total, f"only {spans} of {total} leases have a span to check"
    overlaps = []
    for key, key_spans in by_key.items():
        key_spans.sort()
        for (_s1, e1, id1), (s2, _e2, id2) in zip(key_spans, key_spans[1:], strict=False):
            if s2 < e1:
                overlaps.append((key, id1, id2, e1 - s2))
    assert not overlaps, f"{len(overlaps)} overlapping leases, first: {overlaps[:3]}"


def _lease_spans(docs: list[dict], final: list[tuple[int, int]]):
    """From the claimers' logs: lease id -> (key, start), lease id -> [ends]."""
    starts: dict[int, tuple[str, int]] = {}
    ends: dict[int, list[int]] = defaultdict(list)
    for doc in docs:
        for key, lease_id, start, end, outcome in doc["held"]:
            assert lease_id not in starts, f"lease id {lease_id} granted twice"
            starts[lease_id] = (key, start)
            if outcome in ("completed", "released"):
                ends[lease_id].append(end)
        for _key, lease_id, swept_at in doc["swept"]:
            ends[lease_id].append(swept_at)
    for lease_id, swept_at in final:
        ends[lease_id].append(swept_at)
    return starts, ends


@pytest.mark.timeout(60)
def test_claimers_never_hold_one_key_at_once(node, tmp_path):
    _exclusive_claims(node, tmp_path, procs=8, grants=2_500)  # 20,000 grants


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_claimers_never_hold_one_key_at_once_200k(node, tmp_path):
    _exclusive_claims(node, tmp_path, procs=8, grants=25_000)


def _churner(node: str, seed: int, seconds: float, keys: list[str]) -> None:
    """Grant, complete, release and sweep ``keys`` as fast as it can."""
    rnd = random.Random(seed)
    table = LeaseTable.attach(node)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        key = rnd.choice(keys)
        now = T0 + rnd.uniform(-5, 5)
        lease = table.grant(key, "churner", 1.0, now, 4.0)
        if lease:
            if rnd.random() < 0.5:
                table.complete(key, lease.lease_id, now)
            elif rnd.random() < 0.8:
                table.release(key, lease.lease_id, now)
        if rnd.random() < 0.05:
            table.expire(now)
    table.close()


@pytest.mark.timeout(60)
def test_excluded_keys_read_whole_keys_while_slots_change_under_them(node):
    """Keys whose slots change (and are given to other keys) while the scan
    reads them never come back torn; keys leased throughout always come back."""
    pinned = {f"pinned-{i}-" + "p" * (150 * i) for i in range(5)}  # up to 600 bytes
    rnd = random.Random(3)
    churn = list({_random_key(rnd) for _ in range(90)})
    with LeaseTable.create(node, capacity=64, long_blocks=24, max_misses=1000) as t:
        for key in pinned:
            assert _grant(t, key, T0, lease_s=1e9)
        children = [SPAWN.Process(target=_churner, args=(node, i, 1.5, churn)) for i in range(2)]
        for child in children:
            child.start()
        universe = pinned | set(churn)
        calls = 0
        follower, followed = LeaseTable.attach(node), set()
        while any(child.is_alive() for child in children):
            got = t.excluded_keys(T0)
            assert pinned <= got <= universe, got - universe or pinned - got
            _follow(follower, followed, T0)
            assert pinned <= followed <= universe, followed - universe or pinned - followed
            calls += 1
        for child in children:
            child.join(DEADLINE_S)
            assert child.exitcode == 0
        assert calls > 20
        assert t.excluded_keys(T0) == t._excluded_keys_py(T0)
        _follow(follower, followed, T0)
        follower.close()
        assert followed == t._excluded_keys_py(T0)


def _rewriter(node: str, idx: int, seconds: float, keys: list[bytes]) -> None:
    """Give slot ``idx`` each of ``keys`` (of one length) in turn, as fast as
    it can, the way an insert writes a key: CLAIMING, the bytes, LEASED."""
    table = LeaseTable.attach(node)
    view, mm, state, at = table._view, table.mm, leases.STATES + 8 * idx, table._slot(idx)
    block = struct.unpack_from("<I", mm, at + 4)[0]
    rest = table._lay.blocks + leases.BLOCK_SIZE * (block - 1)
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        w = view.load64(state)
        own = leases._next(w, leases.CLAIMING, leases._copy(w), owner=leases.owner_bits())
        assert view.cas64(state, w, own) == w
        key = keys[n % len(keys)]
        n += 1
        mm[at + leases.KEY_AT : at + leases.KEY_AT + leases.INLINE_KEY] = key[: leases.INLINE_KEY]
        mm[rest : rest + len(key) - leases.INLINE_KEY] = key[leases.INLINE_KEY :]
        assert view.cas64(state, own, leases._next(own, leases.LEASED, leases._copy(own))) == own
    table.close()


@pytest.mark.timeout(60)
def test_excluded_keys_never_read_a_key_half_rewritten(node):
    """A process rewrites one slot's key over and over (a new key in a reused
    slot, at full speed): every answer has one of its keys whole, or none."""
    keys = ["A" * 300 + "ä" * 100, "B" * 300 + "ö" * 100]  # 500 bytes, one length
    with LeaseTable.create(node, capacity=16, long_blocks=2) as t:
        assert _grant(t, keys[0], T0) and _grant(t, "steady", T0)
        kb = keys[0].encode()
        idx = t._lookup(kb, leases._hash(kb))[0]
        child = SPAWN.Process(
            target=_rewriter, args=(node, idx, 1.0, [key.encode() for key in keys])
        )
        child.start()
        seen: dict[str, int] = defaultdict(int)
        while child.is_alive():
            got = t.excluded_keys(T0)
            assert "steady" in got and got - {"steady"} <= set(keys), got
            for key in got:
                seen[key] += 1
        child.join(DEADLINE_S)
        assert child.exitcode == 0
        assert seen[keys[0]] and seen[keys[1]], dict(seen)


def _counting_claimer(node: str, seed: int, grants: int, counters_path: str) -> None:
    """Leases that never expire, each ended by its holder. Around each one the
    holder counts itself in a per-key counter (a file mapped by every claimer):
    +1 after the grant returned, -1 before the end is asked for, both inside
    the real holding period. Any count above one is two holders at once."""
    import mmap

    from shm import _atomic

    rnd = random.Random(seed)
    table = LeaseTable.attach(node)
    with open(counters_path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    counters = _atomic.View(mm)
    keys = len(mm) // 8 - 1  # the last word counts collisions
    got = 0
    deadline = time.monotonic() + 120
    while got < grants and time.monotonic() < deadline:
        k = rnd.randrange(keys)
        lease = table.grant(f"key-{k}", "c", 3600, time.time(), 0.001)
        if not lease:
            continue
        got += 1
        if counters.add64(8 * k, 1) != 0:
            counters.add64(8 * keys, 1)
        counters.add64(8 * k, (1 << 64) - 1)  # -1
        if rnd.random() < 0.7:
            outcome = table.complete(lease.key, lease.lease_id, time.time())
            assert outcome is Outcome.COMPLETED, outcome
        else:
            outcome = table.release(lease.key, lease.lease_id, time.time())
            assert outcome is Outcome.RELEASED, outcome
    counters.release()
    mm.close()
    table.close()
    if got < grants:
        raise SystemExit(f"only {got} grants before the deadline")


@pytest.mark.timeout(60)
def test_holders_counted_around_each_lease_never_meet(node, tmp_path):
    keys = 24
    counters = tmp_path / "counters"
    counters.write_bytes(bytes(8 * (keys + 1)))
    # Fewer slots than keys: keys keep losing their idle slots to others and
    # being inserted again, racing each other for free slots.
    with LeaseTable.create(node, capacity=16, max_misses=1000) as table:
        children = [
            SPAWN.Process(target=_counting_claimer, args=(node, i, 2_500, str(counters)))
            for i in range(8)
        ]
        for child in children:
            child.start()
        for child in children:
            child.join(timeout=60)
            assert child.exitcode == 0
        words = memoryview(counters.read_bytes()).cast("Q").tolist()
        assert words == [0] * (keys + 1), f"{words[-1]} grants found another holder"
        stats = table.stats()
        assert stats["grants"] == 8 * 2_500
        assert table.live() == []


def _racer(node: str, keys: int, out_path: str, go) -> None:
    table = LeaseTable.attach(node)
    go.wait(DEADLINE_S)
    won = []
    for i in range(keys):
        while True:
            lease = table.grant(f"fresh-{i}", str(os.getpid()), 3600, T0, 3600)
            if lease:
                won.append(i)
            if lease or lease.reason is not Refuse.BUSY:
                break
    table.close()
    Path(out_path).write_bytes(msgpack.packb(won))


@pytest.mark.timeout(60)
def test_racing_inserts_of_new_keys_have_exactly_one_winner(
    node, tmp_path, monkeypatch, stops_build
):
    # Every insert pauses between claiming a free slot and writing its key, so
    # racers walking the same keys meet inside each other's insert often.
    monkeypatch.setenv("QUEUE_NODE_TEST_LEASE_STOP", "insert:pause")
    monkeypatch.setenv("QUEUE_NODE_TEST_BUILD", str(stops_build))
    keys = 1500
    with LeaseTable.create(node, capacity=4096) as table:
        go = SPAWN.Event()
        paths = [str(tmp_path / f"racer-{i}") for i in range(6)]
        children = [SPAWN.Process(target=_racer, args=(node, keys, p, go)) for p in paths]
        for child in children:
            child.start()
        go.set()
        for child in children:
            child.join(timeout=DEADLINE_S)
            assert child.exitcode == 0
        winners = defaultdict(int)
        for path in paths:
            for i in msgpack.unpackb(Path(path).read_bytes()):
                winners[i] += 1
        assert winners == dict.fromkeys(range(keys), 1)
        assert len(table.live(limit=keys + 1)) == keys
        assert table.stats()["backoffs"] > 0, "the racers never met: the test shows nothing"


# -- dying mid-grant ------------------------------------------------------------------

_STOPPED_GRANT = textwrap.dedent(
    """
    import sys
    from shm.leases import LeaseTable
    table = LeaseTable.attach(sys.argv[1])
    lease = table.grant(sys.argv[2], "child", 60, float(sys.argv[3]), 3600)
    print("granted" if lease else "refused", flush=True)
    """
)


def _stopped_child(node: str, key: str, point: str, stops: Path) -> subprocess.Popen:
    env = dict(
        os.environ,
        QUEUE_NODE_TEST_LEASE_STOP=f"{point}:stop",
        QUEUE_NODE_TEST_BUILD=str(stops),
        PYTHONPATH=str(ROOT),
    )
    child = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_GRANT, node, key, repr(LATER)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    wait_until(
        lambda: proc_state(child.pid) == "T" or child.poll() is not None,
        f"the child to stop at {point}",
    )
    assert child.poll() is None, f"the child never reached {point}: {child.communicate()}"
    return child


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", ["update", "written", "keyed"])
def test_a_grant_killed_while_it_holds_the_slot_does_not_wedge_the_key(node, point, stops_build):
    with LeaseTable.create(node, capacity=64) as table:
        missed = None
        if point != "keyed":  # the key has a slot already: the child updates it
            missed = _grant(table, "k", T0)
            table.release("k", missed.lease_id, T0, error="first miss")
        child = _stopped_child(node, "k", point, stops_build)
        try:
            # Stopped, not dead: its slot is left alone, whatever the wait.
            assert _grant(table, "k", LATER) == Refused(Refuse.BUSY)
            assert table.is_excluded("k", LATER)
        finally:
            child.kill()
            child.communicate(timeout=DEADLINE_S)
        if missed is not None:
            # Rolled back to the record before the grant, untouched by the
            # child's writes (they went to the other copy).
            [hold] = [h for h in table.held() if h.key == "k"]
            assert (hold.lease_id, hold.misses, hold.last_error) == (
                missed.lease_id,
                1,
                "first miss",
            )
        lease = _grant(table, "k", LATER)
        assert lease, f"the key stayed wedged: {lease}"
        assert lease.misses == (0 if missed is None else 1)
        assert table.stats()["reclaimed"] == 1
        assert _grant(table, "k", LATER) == Refused(Refuse.LEASED)


@pytest.mark.timeout(60)
def test_a_grant_killed_while_claiming_a_free_slot_loses_only_that_slot_until_a_sweep(
    node, stops_build
):
    with LeaseTable.create(node, capacity=16) as table:
        child = _stopped_child(node, "k", "insert", stops_build)
        try:
            assert _grant(table, "k", T0), "a claim without a key blocks nothing"
        finally:
            child.kill()
            child.communicate(timeout=DEADLINE_S)
        assert table.stats()["slots"]["claiming"] == 1
        assert table.expire(T0) == []
        stats = table.stats()
        assert stats["slots"]["claiming"] == 0 and stats["reclaimed"] == 1


@pytest.mark.timeout(60)
def test_insert_resumed_after_losing_the_race_backs_off(node, stops_build):
    """Regression shape of the insert race: one process claims a free slot and
    stops; another inserts the same key; the first resumes and must not lease
    it too."""
    with LeaseTable.create(node, capacity=64) as table:
        child = _stopped_child(node, "k", "insert", stops_build)
        lease = _grant(table, "k", LATER)
        assert lease
        os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate(timeout=DEADLINE_S)
        assert out.strip() == "refused"
        assert child.returncode == 0
        assert [(x.key, x.lease_id) for x in table.live()] == [("k", lease.lease_id)]
        assert table.stats()["backoffs"] == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", ["written", "keyed"])
def test_a_slot_a_killed_grant_left_updating_is_excluded_until_rolled_back(
    node, point, stops_build
):
    with LeaseTable.create(node, capacity=64) as table:
        key = "k"
        if point == "written":  # the child updates the slot of a held key
            missed = _grant(table, key, T0)
            table.release(key, missed.lease_id, T0)  # held until T0 + 20
        else:  # the child inserts a long key
            key = "l" * 300 + "ü" * 200
        child = _stopped_child(node, key, point, stops_build)
        child.kill()
        child.communicate(timeout=DEADLINE_S)
        assert table.stats()["slots"]["updating"] == 1
        for now in (T0, LATER):  # mid-change: excluded whatever the hold says
            assert table.excluded_keys(now) == {key} == table._excluded_keys_py(now)
        table.expire(T0)  # rolls back the dead child's slot
        assert table.stats()["slots"]["updating"] == 0
        assert table.excluded_keys(T0) == ({key} if point == "written" else set())
        assert table.excluded_keys(LATER) == set() == table._excluded_keys_py(LATER)


# -- crash and restart -------------------------------------------------------------------


def _create_grant_and_die(node: str) -> None:
    table = LeaseTable.create(node, capacity=128)
    for i in range(10):
        table.grant(f"k{i}", "gpu-0", 600, T0, 3600)
    os._exit(0)  # no close, no save, no unlink: a crash


@pytest.mark.timeout(60)
def test_the_restarted_node_reattaches_to_the_leases_a_crash_left(node):
    child = SPAWN.Process(target=_create_grant_and_die, args=(node,))
    child.start()
    child.join(DEADLINE_S)
    assert child.exitcode == 0
    with LeaseTable.create(node, capacity=4096) as table:  # another capacity: ignored
        assert table.segment.reattached and table.capacity == 128
        assert table.segment.owner_pid == os.getpid()
        live = table.live()
        assert sorted(lease.key for lease in live) == [f"k{i}" for i in range(10)]
        assert _grant(table, "k3", T0 + 1) == Refused(Refuse.LEASED)
        k3 = next(lease for lease in live if lease.key == "k3")
        assert table.complete("k3", k3.lease_id, T0 + 2) is Outcome.COMPLETED
        assert _grant(table, "k3", T0 + 3)
