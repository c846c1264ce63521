"""The lease table's grant in C (shm/_claim.c) against the Python grant.

The C grant is the same protocol as ``LeaseTable._grant_py`` for its common
cases and hands every other case to it. So: the key hash equals hashlib's;
the same operations on two tables, one granting in C and one in Python, give
the same answers and leave the same bytes; the common cases never reach the
Python path. The real-process tests (exclusivity, dying mid-grant at each
stop point, racing inserts) are in tests/integration/test_leases.py and run through the C
grant there.
"""

from __future__ import annotations

import hashlib
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.core.names import shm_segment_name
from shm import _claim, leases, segment
from shm.leases import LeaseTable, Outcome, Refuse, Refused

T0 = 1_700_000_000.0


def _blake2b_int(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@given(st.binary(max_size=1100))
@settings(max_examples=400, deadline=None)
def test_the_c_key_hash_is_hashlibs_blake2b(data):
    assert _claim.blake2b64(data) == _blake2b_int(data)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 129, 255, 256, 257, 1024])
def test_the_c_key_hash_at_block_boundaries(size):
    data = bytes(range(256)) * 5
    assert _claim.blake2b64(data[:size]) == _blake2b_int(data[:size])


@pytest.fixture
def pair():
    """Two tables made alike: ``c`` grants in C, ``py`` only in Python."""
    names = [f"t{uuid.uuid4().hex[:12]}" for _ in range(2)]
    tables = [LeaseTable.create(n, capacity=16, long_blocks=2, max_misses=3, now=T0) for n in names]
    tables[1]._granter.release()
    tables[1]._granter = None
    yield tables
    for t, n in zip(tables, names, strict=True):
        t.close()
        segment.unlink(shm_segment_name(n, "leases"))


KEYS = ["a", "b", "key-ü", "c" * 208, "d" * 209, "e" * 300 + "ö" * 100] + [
    f"k{i}" for i in range(20)
]

OPS = st.lists(
    st.tuples(
        st.sampled_from(["grant", "grant", "grant", "complete", "release", "expire", "clear"]),
        st.sampled_from(KEYS),
        st.integers(min_value=0, max_value=400),  # seconds after T0
    ),
    max_size=80,
)


def _slots(t: LeaseTable) -> bytes:
    """Everything a grant may write: counters, states, hashes, maxdist, slots."""
    lay = t._lay
    return bytes(t.mm[40 : lay.size])


@given(ops=OPS)
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_c_and_python_grants_answer_alike_and_leave_the_same_bytes(pair, ops):
    c, py = pair
    for t in pair:  # a fresh start for every example: free every slot again
        t.mm[leases.STATES : t._lay.blocks] = bytes(t._lay.blocks - leases.STATES)
        t.mm[40:128] = bytes(88)
    last: dict[str, int] = {}
    for op, key, dt in ops:
        now = T0 + dt
        if op == "grant":
            a, b = (t.grant(key, "consumer-ü" * 4, 10.0, now, 100.0, version=dt) for t in pair)
            assert a == b, (op, key)
            if a:
                last[key] = a.lease_id
        elif op == "complete":
            lease_id = last.get(key, 1)
            assert c.complete(key, lease_id, now) == py.complete(key, lease_id, now)
        elif op == "release":
            lease_id = last.get(key, 1)
            assert c.release(key, lease_id, now, "err") == py.release(key, lease_id, now, "err")
        elif op == "expire":
            assert c.expire(now) == py.expire(now)
        else:
            assert c.clear_on_write(key) == py.clear_on_write(key)
        assert _slots(c) == _slots(py), (op, key)


def test_the_common_cases_never_reach_the_python_grant(node_table, monkeypatch):
    t = node_table
    calls = []
    real = t._grant_py

    def spy(*args):
        calls.append(args[2])
        return real(*args)

    monkeypatch.setattr(t, "_grant_py", spy)
    first = t.grant("k", "c", 10.0, T0, 100.0)  # a new key: the insert
    assert first and first.misses == 0
    assert t.grant("k", "c", 10.0, T0, 100.0) == Refused(Refuse.LEASED)
    assert t.release("k", first.lease_id, T0) is Outcome.RELEASED
    assert t.grant("k", "c", 10.0, T0 + 1, 100.0) == Refused(Refuse.HELD)
    second = t.grant("k", "c", 10.0, T0 + 21, 100.0)  # the hold passed
    assert second and second.misses == 1 and second.lease_id > first.lease_id
    for n in range(2):
        t.release("k", second.lease_id, T0 + 21 + n)
        second = t.grant("k", "c", 10.0, T0 + 1000 * (n + 1), 100.0) or second
    assert t.grant("k", "c", 10.0, T0 + 9000, 100.0) == Refused(Refuse.PARKED)
    assert t.complete("k", second.lease_id, T0) in (Outcome.LATE, Outcome.COMPLETED)
    assert t.grant("k", "c", 10.0, T0 + 9000, 100.0)  # idle again
    assert calls == []
    assert t.grant("l" * 209, "c", 10.0, T0, 100.0)  # a long key: Python's
    assert calls == ["l" * 209]


@pytest.fixture
def node_table():
    name = f"t{uuid.uuid4().hex[:12]}"
    t = LeaseTable.create(name, capacity=64, max_misses=3, now=T0)
    yield t
    t.close()
    segment.unlink(shm_segment_name(name, "leases"))


def test_a_full_table_refuses_through_the_python_path(node_table):
    t = node_table
    for i in range(t.capacity):
        assert t.grant(f"k{i}", "c", 10.0, T0, 100.0)
    assert t.grant("one-more", "c", 10.0, T0, 100.0) == Refused(Refuse.FULL)
    assert t.stats()["refused_full"] == 1


def test_the_granter_checks_its_layout_and_arguments(node_table):
    t = node_table
    lay = t._lay
    with pytest.raises(ValueError):
        _claim.Granter(t.mm, t.capacity, lay.hashes + 8, lay.maxdist, lay.owners, lay.slots,
                       lay.blocks, lay.long_blocks, lay.size)  # fmt: skip
    with pytest.raises(ValueError):
        _claim.Granter(t.mm, t.capacity * 2, lay.hashes, lay.maxdist, lay.owners, lay.slots,
                       lay.blocks, lay.long_blocks, lay.size)  # fmt: skip
    g = t._granter
    with pytest.raises(ValueError):
        g.grant(b"", b"c", 10.0, T0, 100.0, 0, 0, 0)
    with pytest.raises(ValueError):
        g.grant(b"k", b"c" * 33, 10.0, T0, 100.0, 0, 0, 0)
    with pytest.raises(ValueError):
        g.grant(b"k", b"c", 0.0, T0, 100.0, 0, 0, 0)
    with pytest.raises(TypeError):
        g.grant("k", b"c", 10.0, T0, 100.0, 0, 0, 0)
    assert t.live() == []
