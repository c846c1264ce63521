"""Unit: what an ack through a fleet answers when its shares' checks fail
(``workers.http.cluster._checked``), and the items ``complete_many`` takes
(``node.core.rows.completions``). Each check is a real coroutine; nothing
sleeps."""

from __future__ import annotations

import asyncio
from collections import namedtuple

import pytest

from node.core.errors import ClientError
from node.core.rows import completions
from workers.http.cluster import _checked
from workers.http.errors import ApiError

pytestmark = pytest.mark.timeout(30)


async def _answer(doc: dict) -> dict:
    return doc


async def _raise(exc: BaseException) -> dict:
    raise exc


def _never(node: str, ids: str) -> ApiError:
    return ApiError(409, "never_offered", f"node {node}: job 'j': ids never offered: {ids}", "ids")


def _run(checks: list, unheld: list[int] | None = None) -> list[dict]:
    return asyncio.run(_checked("j", checks, unheld or []))


def test_every_check_answered_is_their_answers_in_order() -> None:
    assert _run([_answer({"checked": 2}), _answer({"checked": 1})]) == [
        {"checked": 2}, {"checked": 1},
    ]  # fmt: skip


def test_every_refusal_and_every_unheld_id_is_named_in_one_409() -> None:
    with pytest.raises(ApiError) as info:
        _run([_raise(_never("a", "5, 6")), _answer({"checked": 1}), _raise(_never("b", "9"))],
             unheld=[77, 78, 77])  # fmt: skip
    error = info.value
    assert (error.status, error.code) == (409, "never_offered")
    assert str(error) == (
        "node a: job 'j': ids never offered: 5, 6; node b: job 'j': ids never offered: 9; "
        "job 'j': ids no node holds, never offered: 77, 78"
    )


def test_a_refusal_wins_over_a_node_that_did_not_answer() -> None:
    late = ApiError(503, "peer_unavailable", "node b did not answer in 2 s")
    with pytest.raises(ApiError) as info:
        _run([_raise(late), _raise(_never("a", "5"))])
    assert info.value.code == "never_offered" and "node b" not in str(info.value)
    with pytest.raises(ApiError) as info:
        _run([_raise(late), _answer({"checked": 1})])
    assert info.value is late


def test_a_bug_in_a_check_is_never_hidden_behind_a_refusal() -> None:
    with pytest.raises(RuntimeError, match="a bug"):
        _run([_raise(_never("a", "5")), _raise(RuntimeError("a bug"))], unheld=[77])


Item = namedtuple("Item", "lease_id key result")


def test_complete_many_items_are_tuples_or_the_http_forms_objects() -> None:
    assert completions([(1, "k", b"x"), [2, "l", None], Item(3, "m", {"a": 1}),
                        {"lease_id": 4, "key": "n", "result": [1]}]) == [
        (1, "k", b"x"), (2, "l", None), (3, "m", {"a": 1}), (4, "n", [1]),
    ]  # fmt: skip
    assert completions(iter([(1, "k", 0)])) == [(1, "k", 0)]
    assert completions([]) == []


@pytest.mark.parametrize(
    ("item", "why"),
    [
        ({"lease_id": 1, "key": "k"}, "has no 'result'"),
        ({"key": "k", "result": 1}, "has no 'lease_id'"),
        ({"lease_id": 1, "key": "k", "result": "eA==", "encoding": "base64"}, "has 'encoding'"),
        ((1, "k"), "is not (lease_id, key, result)"),
        ((1, "k", 2, 3), "is not (lease_id, key, result)"),
        ("abc", "is not (lease_id, key, result)"),
        (None, "is not (lease_id, key, result)"),
    ],
)
def test_any_other_item_is_400_invalid_body_naming_it(item: object, why: str) -> None:
    with pytest.raises(ClientError) as info:
        completions([(1, "k", 0), item])
    error = info.value
    assert (error.status, error.code, error.field) == (400, "invalid_body", "items[1]")
    assert why in error.message, error.message
