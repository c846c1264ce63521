"""``keeper._best.KeyColumn`` (keeper/_keys.c), the keeper's keys by slot as
UTF-8 outside str objects, against ``PyKeyColumn``, the list of str it
replaces: the same answers to every call, the C lookups on it (``find``,
``move_keys``, ``pick``'s exclusion, the ready set's writer) the same as on
the list, and the memory it was made for."""

from __future__ import annotations

import tracemalloc
from array import array
from random import Random

import pytest

from keeper import _best  # type: ignore[attr-defined]  # C, built by setup.py
from keeper.buckets.table import PyKeyColumn

pytestmark = pytest.mark.timeout(60)


def _key(rnd: Random) -> str:
    kind = rnd.random()
    if kind < 0.6:
        return f"https://example.com/items/{rnd.randrange(10**6):010d}/slug-{rnd.randrange(97)}"
    if kind < 0.8:
        return "é" * rnd.randrange(1, 40) + "€" + str(rnd.randrange(1000))
    if kind < 0.9:
        return "k" * rnd.randrange(300, 1100)  # past a 1-byte length
    return rnd.choice(["", "a", "𝄞", "\x00nul"])


def _table(column, cells: int) -> array[int]:
    """A key table (int32 cells, linear probing) over the keys held, built
    from their stored hashes."""
    table = array("i", [-1]) * cells
    for slot in range(len(column)):
        h = column.hash_at(slot)
        if h is None:
            continue
        i = h & (cells - 1)
        while table[i] >= 0:
            i = (i + 1) & (cells - 1)
        table[i] = slot
    return table


def _pair(seed: int, n: int = 400):
    rnd = Random(seed)
    c, py = _best.KeyColumn(), PyKeyColumn()
    keys = list({_key(rnd) for _ in range(n)})
    for col in (c, py):
        col.reserve(len(keys) // 2)
        for key in keys[: len(keys) // 2]:
            col.append(key)
        col.extend(keys[len(keys) // 2 :])
    for slot in rnd.sample(range(len(keys)), len(keys) // 5):  # freed slots
        c[slot] = py[slot] = None
    for slot in rnd.sample(range(len(keys)), 10):  # slots taken again
        key = _key(rnd) + "!"
        c[slot] = py[slot] = key
    return rnd, c, py


@pytest.mark.parametrize("seed", range(5))
def test_the_column_answers_what_the_list_answers(seed):
    rnd, c, py = _pair(seed)
    assert len(c) == len(py)
    assert list(c) == list(py) and [c[i] for i in range(len(c))] == list(py)
    assert c[-1] == py[-1]
    for slot in range(len(c)):
        want = py.hash_at(slot)
        got = c.hash_at(slot)
        assert (got is None) == (want is None)
        if want is not None:
            assert got == want & 0xFFFFFFFF  # its low 32 bits: the same & mask
    cells = 2048
    table = _table(c, cells)
    assert table == _table(py, cells)  # the same low bits, so the same table
    for key in [*filter(None, py), *(_key(rnd) for _ in range(50))]:
        i = c.find(key, table, cells - 1)
        assert i == py.find(key, table, cells - 1)
        slot = table[i]
        assert (slot >= 0) == (key in py) and (slot < 0 or py[slot] == key)
    # what another program stored and the feed may still look up: held by
    # none, the probe ending where the list's ends
    for other in (b"\xff\xfe", "\ud800x", 17, None):
        i = c.find(other, table, cells - 1)
        assert i == py.find(other, table, cells - 1) and table[i] == -1
    with pytest.raises(TypeError):
        c.find([], table, cells - 1)  # unhashable, as the list's hash() raises
    slots = array("i", [s for s in range(len(py)) if py[s] is not None][:100])
    assert c.take(slots, 60) == py.take(slots, 60) == [py[s] for s in slots[:60]]
    copy = _best.KeyColumn()
    copy += list(py)
    assert copy == c and not copy != c
    copy[0] = "other"
    assert copy != c


def test_the_column_refuses_what_the_list_would_not_hold_as_a_key():
    c = _best.KeyColumn()
    c.extend(["a", "b"])
    with pytest.raises(TypeError):
        c.append(b"bytes")
    with pytest.raises(TypeError):
        c.extend(["c", 3])  # nothing of it added
    assert list(c) == ["a", "b"]
    with pytest.raises(UnicodeEncodeError):
        c.append("\ud800")  # a lone surrogate: no UTF-8
    with pytest.raises(ValueError):
        c.append("x" * 0x8000)
    with pytest.raises(IndexError):
        c[2]
    with pytest.raises(IndexError):
        c[2] = "x"
    with pytest.raises(TypeError):
        del c[0]
    with pytest.raises(IndexError):
        c.hash_at(5)
    with pytest.raises(ValueError):
        c.find("a", array("i", [-1] * 3), 2)  # not mask + 1 cells
    with pytest.raises(ValueError):
        c.take(array("i", [0]), 2)
    with pytest.raises(TypeError):
        _best.KeyColumn(["a"])
    assert list(c) == ["a", "b"]


def test_the_c_lookups_read_the_column_as_they_read_the_list():
    """move_keys and pick's exclusion over a KeyColumn give what they give
    over the list of the same keys."""
    rnd, c, py = _pair(7, n=600)
    cells = 2048
    table = _table(c, cells)
    det = bytearray(len(c))
    cids = array("i", [slot % 5 for slot in range(len(c))])
    mins = array("i", [slot // 3 for slot in range(len(c))])
    held = [key for key in py if key is not None]
    asked = [*rnd.sample(held, 150), "no such key", "ünknown", b"\xff", "\udc80", 3]
    moved = {}
    for col in (c, list(py)):
        by_class: dict[int, list[int]] = {}
        flags = bytearray(det)
        n = _best.move_keys(asked, table, cells - 1, col, flags, cids, mins, 1, by_class)
        moved[type(col)] = (n, by_class, flags)
    assert moved[type(c)] == moved[list] and moved[list][0] == 150
    # pick over one run of every held slot, the same exclusions either way
    values = array("q", sorted(s for s in range(len(py)) if py[s] is not None))
    excluded = set(rnd.sample(held, 200)) | {"not held", 7, b"bytes", "\ud800"}
    for exclude in (excluded, frozenset(excluded), list(excluded), {}, None):
        picks = [
            _best.pick(values, [0], [3600.0], [0.0], [1], 1e9, len(values), keys, exclude)
            for keys in (c, list(py))
        ]
        assert picks[0] == picks[1]
        if exclude:
            assert picks[0][2] == 200  # skipped


def test_a_54_character_key_takes_under_90_bytes_a_slot():
    """What the column is for: 1,000 keys of 54 characters take their block
    (64 bytes with its header), a pointer and a hash (8 + 4) a slot, where a
    str in a list took 112 + 8."""
    keys = [f"https://example.com/items/{i:010d}/some-slug-text-{i % 97:02d}" for i in range(1000)]
    assert {len(k) for k in keys} == {54}
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        c = _best.KeyColumn()
        c.reserve(len(keys))
        c.extend(keys)
        per_slot = (tracemalloc.get_traced_memory()[0] - before) / len(keys)
    finally:
        tracemalloc.stop()
    assert list(c) == keys
    assert 56 + 12 <= per_slot < 90, per_slot


def test_a_key_the_column_refuses_changes_nothing_in_the_buckets():
    """A key with no UTF-8 (a lone surrogate: the stores never hand one in,
    their text is UTF-8) is refused by the column; the load or the apply that
    brought it raises and leaves the buckets as they were, every other key
    still found."""
    from keeper.buckets import Buckets
    from keeper.classes import ClassTable
    from node.core.config import Config

    buckets = Buckets(ClassTable(Config(name="t", workers=1)))

    def row(key: str, version: int = 1) -> tuple:
        return (key, version, "r", None, False, 1e9)

    buckets.load_rows([row("k1"), row("k3")])
    buckets.remove("k3")  # a free slot, taken first by the next new key
    free = list(buckets._free)
    for bad in (
        # past the walk's last key, with no row from elsewhere: the load's C path
        lambda: buckets.load_rows([row("m1"), row("m\ud800")]),
        lambda: buckets.load_rows([row("k2"), row("k\ud800")]),
        lambda: buckets.load_rows([row("a\ud800"), row("k1", 2)]),
        lambda: buckets.apply(*row("k\udc00")),
    ):
        with pytest.raises(UnicodeEncodeError):
            bad()
        assert list(buckets._free) == free and len(buckets) == 1
        assert buckets.get("k1") is not None and buckets.get("k2") is None
        assert len(buckets._keys) == len(buckets._vers) == len(buckets._det)
        assert max(buckets._table) < len(buckets._keys)  # no cell names a slot not there
    assert buckets.apply(*row("k4"))
    assert {key for key, *_ in buckets.items()} == {"k1", "k4"}


def test_the_column_refuses_sizes_and_tables_that_would_reach_past_it():
    c = _best.KeyColumn()
    c.append("a")
    with pytest.raises(MemoryError):
        c.reserve(2**62)
    with pytest.raises(ValueError):
        c.reserve(-1)
    c.append("b" * 100)
    for table, mask in ((b"", 2**62 - 1), (b"\xff" * 8, 2**62 - 1), (b"\xff" * 6, 1)):
        with pytest.raises(ValueError):
            c.find("zzz", table, mask)
        with pytest.raises(ValueError):
            _best.move_keys(["zzz"], table, mask, c, bytearray(2), array("i", [0, 0]),
                            array("i", [0, 0]), 1, {})  # fmt: skip
    with pytest.raises(ValueError):
        c.take(array("i", [0]), 2**62)
    c.truncate(1)
    assert list(c) == ["a"]


def test_extend_holds_its_keys_while_their_hashes_run_python():
    keys = ["a", "b", "c"]

    class Growing(str):
        def __hash__(self) -> int:
            keys.extend(["x"] * 10_000)  # the list passed in grows mid-extend
            return 1

    keys[1] = Growing("b")
    c = _best.KeyColumn()
    c.extend(keys)
    assert list(c) == ["a", "b", "c"]


def test_the_ready_set_writer_reads_only_a_key_column_through_its_capsule(tmp_path):
    import uuid

    from shm.ready import ReadySet

    class Fake:
        _api = _best.KeyColumn._api  # the capsule, on another type

    name = f"kc{uuid.uuid4().hex[:8]}"
    ready = ReadySet.create(name, 4)
    try:
        args = (array("q", [1]), array("i", [0]), array("i", [5]), array("i", [1]),
                array("d", [1.0]), 1, 1.0)  # fmt: skip
        with pytest.raises(TypeError):
            ready.publish_gathered(Fake(), *args)  # type: ignore[arg-type]
        c = _best.KeyColumn()
        c.append(None)
        with pytest.raises(TypeError):  # a freed slot
            ready.publish_gathered(c, *args)
        c[0] = "é-key"
        assert ready.publish_gathered(c, *args) == 1
        assert [e.key for e in ready.snapshot().entries] == ["é-key"]
    finally:
        ready.close()
        ReadySet.unlink(name)


def test_a_slot_set_by_a_key_whose_hash_truncates_the_column_is_refused():
    c = _best.KeyColumn()
    c.extend(["a", "b"])

    class Truncating(str):
        def __hash__(self) -> int:
            c.truncate(0)
            return 1

    with pytest.raises(IndexError):
        c[1] = Truncating("zz")  # the slot is gone once the hash has run
    assert len(c) == 0
