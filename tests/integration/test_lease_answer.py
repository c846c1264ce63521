"""A claim's answer built lease by lease (``workers.http.work._LeaseAnswer``):
which encoding it ends in, and what it does with a lease that encoding
cannot carry, against the bytes it answers.

A claim asked for in msgpack whose lease msgpack cannot carry (an integer
past 64 bits another program stored) comes in JSON when JSON carries every
lease of it within the bound. A lease one accepted encoding carries but not
the answer's is ``LATER`` (handed back by the claim, no miss), one that no
accepted encoding carries is ``Unsendable`` (released with the reason), and
one past the bound ``FULL``.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest

from node.core.rows import Grant
from workers.http.errors import Unsendable
from workers.http.work import ADDED, FULL, LATER, _LeaseAnswer

pytestmark = pytest.mark.timeout(30)

BIG = 1 << 70
LIMIT = 16 << 20


def _grant(key: str, payload: Any) -> Grant:
    return Grant(7, key, payload, "j", 1.0, 61.0)


def _body(answer: _LeaseAnswer) -> tuple[str, Any]:
    response = answer.response()
    assert response.body is not None
    raw = bytes(response.body)  # type: ignore[arg-type]
    if response.content_type == "application/msgpack":
        return response.content_type, msgpack.unpackb(raw)
    return response.content_type, json.loads(raw)


def test_a_lease_msgpack_cannot_carry_turns_the_answer_into_json() -> None:
    answer = _LeaseAnswer(raw=True, limit=LIMIT)
    assert answer.add(_grant("plain", [1])) == ADDED
    assert answer.add(_grant("big", [BIG])) == ADDED
    kind, body = _body(answer)
    assert kind == "application/json"
    assert [(x["key"], x["payload"]) for x in body["leases"]] == [("plain", [1]), ("big", [BIG])]
    # Once in JSON, a blob (msgpack would carry it) waits for a later answer.
    assert answer.add(_grant("blob", b"\x00\xff")) == LATER
    assert answer.count == 2 and _body(answer)[0] == "application/json"


def test_beside_a_blob_the_big_integer_waits_and_the_answer_stays_msgpack() -> None:
    answer = _LeaseAnswer(raw=True, limit=LIMIT)
    assert answer.add(_grant("blob", b"\x00\xff")) == ADDED
    assert answer.add(_grant("big", [BIG])) == LATER
    kind, body = _body(answer)
    assert kind == "application/msgpack"
    assert [(x["key"], x["payload"]) for x in body["leases"]] == [("blob", b"\x00\xff")]


def test_what_no_accepted_encoding_carries_is_unsendable() -> None:
    json_only = _LeaseAnswer(raw=False, limit=LIMIT)
    with pytest.raises(Unsendable, match="JSON"):
        json_only.add(_grant("blob", b"\x00\xff"))
    both = _LeaseAnswer(raw=True, limit=LIMIT)
    with pytest.raises(Unsendable, match="JSON"):  # a blob and a big integer: neither
        both.add(_grant("odd", [b"\x00", BIG]))
    assert json_only.count == both.count == 0


def test_a_switch_that_would_pass_the_bound_waits_instead_of_releasing() -> None:
    """JSON is larger than msgpack: an answer near its bound in msgpack may
    not fit in JSON. Then the big integer's lease waits for a later answer
    (before: released with a miss, as if no encoding carried it)."""
    text = "é" * 500  # 1,000 bytes in msgpack, 3,002 in JSON's escapes
    answer = _LeaseAnswer(raw=True, limit=20_000)
    for i in range(15):
        assert answer.add(_grant(f"k{i}", text)) == ADDED
    assert answer.add(_grant("big", [BIG])) == LATER
    kind, body = _body(answer)
    assert kind == "application/msgpack" and len(body["leases"]) == 15


def test_the_bound_in_either_encoding_and_the_size_counted() -> None:
    for raw in (True, False):
        answer = _LeaseAnswer(raw=raw, limit=4_000)
        added = 0
        while answer.add(_grant(f"k{added}", "x" * 500)) == ADDED:
            added += 1
        assert added >= 1 and answer.count == added
        response = answer.response()
        assert response.body is not None
        assert len(response.body) <= answer.size <= 4_000  # type: ignore[arg-type]
        assert answer.add(_grant("more", "x")) in (ADDED, FULL)
