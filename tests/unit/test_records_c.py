"""The ledger's group steps in C (``node/completion/segments/_records.c``)
against their Python references, edge cases included: ``make_results``
(``process._make_results_py``), ``plain_results``
(``result_checks._plain_results_py``), ``plain_items``
(``requests._plain_items_py``) and ``offer_dicts`` (``process._offer_dicts_py``).

A "plain" answer of False is never wrong (the caller then checks item by
item), so the C pass may say False where Python says True only for a value
of a subclass; every other answer must match.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.completion import result_checks
from node.completion.base import MAX_RECORD_BYTES, Result, make_result
from node.completion.segments import _records
from workers.ledger import process, requests

T0 = 1_800_000_000.5


class _Str(str):
    __slots__ = ()


class _Int(int):
    pass


def _item(i: int) -> tuple:
    """An intake item: key, lease id, data, encoding, job, version, cadence_s."""
    return (f"k-{i}", i + 1, bytes([i % 256]) * (i % 7), ("json", "bytes")[i % 2], f"j{i % 3}",
            i * 1000, 60.0 + i)  # fmt: skip


def test_the_extension_is_built_and_the_ledger_uses_it():
    assert process._make_results is not process._make_results_py, "build_ext --inplace"
    assert process._offer_dicts is _records.offer_dicts
    assert requests._plain_items_c is _records.plain_items
    assert result_checks.plain_results([make_result("k", "j", 1, 1, T0, 60.0, b"", "json")])
    assert result_checks._plain_c is _records.plain_results


@pytest.mark.parametrize("n", [0, 1, 64, 1000])
def test_make_results_is_make_result_of_each(n):
    items = [_item(i) for i in range(n)]
    made = _records.make_results(Result, items, T0)
    ref = process._make_results_py(items, T0)
    assert made == ref
    assert [hash(r) for r in made] == [hash(r) for r in ref]
    assert all(type(r) is Result and r.id == 0 and r.finished_at == T0 for r in made)
    for r, it in zip(made, items, strict=True):  # the values themselves, not copies
        assert r.key is it[0] and r.data is it[2] and r.job is it[4]
    if made:
        with pytest.raises(AttributeError):
            made[0].key = "other"  # type: ignore[misc]


def test_make_results_keeps_odd_values_as_make_result_does():
    """No check here (append checks): a str lease id, an int time, a subclass."""
    items = [("k", "str-lease", b"x", "json", "j", 3, 60), (_Str("k2"), _Int(5), b"", "bytes",
                                                          "j", 0, 1.5)]  # fmt: skip
    assert _records.make_results(Result, items, 7) == process._make_results_py(items, 7)


def test_make_results_refuses_bad_shapes_and_leaks_nothing():
    with pytest.raises(TypeError):
        _records.make_results(Result, [("k", 1, b"x")], T0)
    with pytest.raises(TypeError):
        _records.make_results(Result, [["k", 1, b"x", "json", "j", 1, 60.0]], T0)
    with pytest.raises(TypeError):
        _records.make_results(Result, ({"not": "a list"},), T0)
    with pytest.raises(AttributeError):  # a class without the fields
        _records.make_results(dict, [_item(1)], T0)

    class Plain:  # the fields, not as slots
        key = job = lease_id = version = finished_at = cadence_s = data = encoding = id = None

    with pytest.raises(TypeError, match="not a slot"):
        _records.make_results(Plain, [_item(1)], T0)
    data = b"payload-" * 100
    items = [("k", 1, data, "json", "j", 1, 60.0)]
    before = sys.getrefcount(data)
    made = _records.make_results(Result, items, T0)
    assert sys.getrefcount(data) == before + 1
    del made
    assert sys.getrefcount(data) == before


def _plain_cases() -> list[list[Result]]:
    good = [make_result(*_item_result(i)) for i in range(5)]
    limit = MAX_RECORD_BYTES - 256
    cases = [[], good]
    odd_fields = [
        {"key": _Str("k")}, {"key": 1}, {"job": None}, {"lease_id": "s"}, {"lease_id": True},
        {"lease_id": _Int(3)}, {"version": 1.0}, {"version": False}, {"finished_at": 5},
        {"cadence_s": 60}, {"data": bytearray(b"x")}, {"data": "str"}, {"encoding": "xml"},
        {"encoding": _Str("json")}, {"encoding": None},
        {"data": b"x" * (limit - 2), "key": "k", "job": "j"},  # at the limit: plain
        {"data": b"x" * (limit - 1), "key": "k", "job": "j"},  # one past it
    ]  # fmt: skip
    for odd in odd_fields:
        fields = dict(zip(_FIELDS, _item_result(0), strict=True))
        fields.update(odd)
        cases.append([*good[:2], make_result(**fields), *good[2:]])
    return cases


_FIELDS = ("key", "job", "lease_id", "version", "finished_at", "cadence_s", "data", "encoding")


def _item_result(i: int) -> tuple:
    key, lease_id, data, encoding, job, version, cadence_s = _item(i)
    return key, job, lease_id, version, T0, cadence_s, data, encoding


@pytest.mark.parametrize("results", _plain_cases())
def test_plain_results_answers_as_python(results):
    py = result_checks._plain_results_py(results)
    c = _records.plain_results(Result, results, result_checks._PLAIN_LIMIT)
    subclass = any(_Str in (type(r.key), type(r.encoding)) or type(r.lease_id) is _Int
                   for r in results)  # fmt: skip
    assert c == py or (subclass and py and not c)
    assert result_checks.plain_results(results) == c
    assert _records.plain_results(Result, tuple(results), result_checks._PLAIN_LIMIT) == c


def test_plain_results_is_false_for_other_types_and_unset_slots():
    class Other:
        key = "k"

    assert not _records.plain_results(Result, [Other()], 10)
    assert not _records.plain_results(Result, iter([]), 10)  # not a list or tuple
    bare = object.__new__(Result)  # no slot set
    assert not _records.plain_results(Result, [bare], 10)


def _request_items() -> list[list[dict]]:
    def item(**kw: object) -> dict:
        base = {"key": "k", "lease_id": 5, "result": b"r", "encoding": "json"}
        base.update(kw)
        return base

    limit = requests._LIMIT
    odd = [
        {}, {"encoding": "bytes"}, {"key": ""}, {"key": "x" * 256}, {"key": "x" * 257},
        {"key": _Str("k")}, {"key": 3}, {"lease_id": 0}, {"lease_id": -1}, {"lease_id": True},
        {"lease_id": 2**70}, {"lease_id": -(2**70)}, {"lease_id": _Int(4)}, {"lease_id": 1.0},
        {"result": "text"}, {"result": bytearray(b"x")}, {"encoding": "xml"},
        {"encoding": None}, {"encoding": _Str("json")},
        {"result": b"x" * (limit - 1)}, {"result": b"x" * limit},
    ]  # fmt: skip
    cases = [[item(**kw)] for kw in odd]
    missing = [item() for _ in range(3)]
    for field in ("key", "lease_id", "result", "encoding"):
        one = [dict(it) for it in missing]
        del one[1][field]
        cases.append(one)
    cases += [[item(), ["not", "a", "map"]], [item(), _DictSub(item())], [item()] * 100]
    return cases


class _DictSub(dict):
    pass


@pytest.mark.parametrize("items", _request_items())
def test_plain_items_answers_as_python(items):
    """The lean pass's answer: C and Python agree (a subclass aside, which
    only sends the request to the field-by-field pass)."""
    seen: list[bool] = []
    original = requests._refuse
    requests._refuse = lambda its: seen.append(True) or its  # type: ignore[assignment]
    try:
        requests._plain_items_py(items)
    finally:
        requests._refuse = original
    py = not seen
    c = _records.plain_items(items, requests._SHORT_KEY, requests._LIMIT)
    subclass = any(
        type(it) is dict
        and (type(it.get("key")) is _Str or type(it.get("lease_id")) is _Int
             or type(it.get("encoding")) is _Str)
        for it in items
    )  # fmt: skip
    assert c == py or (subclass and py and not c)


def test_check_items_answers_the_same_through_either_pass():
    """The whole check, the C lean pass or the Python one: the same items
    back, the same error for a bad one."""
    good = [{"key": "k", "lease_id": 1, "result": b"r", "encoding": "bytes"}]
    no_encoding = [{"key": "k", "lease_id": 1, "result": b"r"}]
    bad = [{"key": "k", "lease_id": 0, "result": b"r", "encoding": "json"}]
    saved = requests._plain_items_c
    answers = []
    try:
        for c_side in (saved, None):
            requests._plain_items_c = c_side
            got = [requests.check_items([dict(it) for it in good]),
                   requests.check_items([dict(it) for it in no_encoding])]  # fmt: skip
            with pytest.raises(Exception) as refused:
                requests.check_items([dict(it) for it in bad])
            answers.append((got, str(refused.value)))
    finally:
        requests._plain_items_c = saved
    assert answers[0] == answers[1]
    assert answers[0][0][1][0]["encoding"] == "json"  # the default, set by the full pass


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 50), fin=st.one_of(st.floats(0, 1e10), st.integers(0, 2**40)))
def test_offer_dicts_are_the_python_offers(n, fin):
    encodings = ("json", "bytes")
    results = [make_result(f"k{i}", f"j{i % 2}", i, i, fin, 60.0, bytes(i), encodings[i % 2])
               for i in range(n)]  # fmt: skip
    ids = [10 * i + 1 for i in range(n)]
    got = _records.offer_dicts(ids, results)
    assert got == process._offer_dicts_py(ids, results)
    assert all(list(d) == ["id", "key", "job", "result", "encoding", "finished_at"] for d in got)


def test_offer_dicts_refuses_mismatched_lengths_and_objects_without_fields():
    results = [make_result("k", "j", 1, 1, T0, 60.0, b"", "json")]
    with pytest.raises(ValueError):
        _records.offer_dicts([1, 2], results)
    with pytest.raises(AttributeError):
        _records.offer_dicts([1], [object()])
    with pytest.raises(TypeError):
        _records.offer_dicts((1,), results)
