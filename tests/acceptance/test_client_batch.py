"""Acceptance: ``Client.complete_many`` (``POST /complete`` with
``{"items": [...]}``) against a real ``python -m node run``.

One request carries an item of each outcome; the accepted ones are durable
(offered again by the node restarted after a ``kill -9``); a malformed item
refuses the request and changes nothing. Waits poll a condition up to a
deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import time

import pytest

from node.client import Client, ClientError
from node.testing import NodeProcess, finish, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def nodes(tmp_path, node_name):
    started: list[NodeProcess] = []
    yield started
    finish(started, node_name)


def _rows(keys: list[str], job: str = "batch") -> list[dict]:
    due = time.time() - 3600
    return [{"key": k, "route": "r", "due_at": due, "payload": {"k": k}, "job": job} for k in keys]


def _claim(client: Client, n: int, consumer: str = "w") -> list:
    got: list = []

    def more() -> bool:
        got.extend(client.claim(n - len(got), lease_s=300, consumer=consumer))
        return len(got) >= n

    wait_for(more, 20, f"{n} claims")
    return got


def test_complete_many_answers_each_item_and_the_accepted_survive_a_kill(
    tmp_path, node_name, nodes
):
    data = tmp_path / "data"
    node = NodeProcess(data, node_name).start()
    nodes.append(node)
    client = Client(node.base_url)
    keys = [f"https://example.com/b/{i}" for i in range(4)]
    client.upsert(_rows(keys))
    grants = {g.key: g for g in _claim(client, 4)}
    a, b, c, d = (grants[k] for k in keys)
    first = client.complete(a.lease_id, a.key, {"n": 0})
    # c is handed back and granted again: its first lease now conflicts.
    client.release(c.lease_id, c.key)
    assert client.unhold([c.key]) == 1
    (c2,) = _claim(client, 1, "other")
    assert c2.key == c.key and c2.lease_id != c.lease_id
    before = client.accounting()

    answers = client.complete_many([
        (a.lease_id, a.key, {"n": 0}),  # a repeat: the first id again
        (b.lease_id, b.key, {"n": 1}),
        (c.lease_id, c.key, {"n": 2}),  # conflict
        (d.lease_id + 1_000_000, d.key, 3),  # no such lease (d's is the next item's)
        (d.lease_id, d.key, b"\x00\xffbytes"),
    ])  # fmt: skip
    assert answers[0] == first
    assert isinstance(answers[1], int) and isinstance(answers[4], int)
    assert isinstance(answers[2], ClientError) and isinstance(answers[3], ClientError)
    conflict, unknown = answers[2], answers[3]
    assert (conflict.status, conflict.code, conflict.field) == (409, "lease_conflict", "lease_id")
    assert (unknown.status, unknown.code, unknown.field) == (409, "lease_unknown", "lease_id")
    after = client.accounting()
    assert after["finished"] - before["finished"] == 2
    live = {x["key"]: x["lease_id"] for x in client.leases()}
    assert live == {c.key: c2.lease_id}  # a, b and d ended; c's new lease untouched

    # A malformed item refuses the whole request: nothing is written.
    with pytest.raises(ClientError) as info:
        client.complete_many([(c2.lease_id, c2.key, 1), (c2.lease_id, "", 2)])
    assert (info.value.status, info.value.code, info.value.field) == (
        400, "invalid_key", "items[1].key"
    )  # fmt: skip
    assert client.accounting()["finished"] == after["finished"]
    assert {x["key"]: x["lease_id"] for x in client.leases()} == live
    assert client.complete_many([]) == []

    # What was answered ok is on disk: the node killed and started again offers it.
    client.close()
    node.kill()
    node = NodeProcess(data, node_name).start()
    nodes.append(node)
    client = Client(node.base_url)
    found: dict = {}

    def offered() -> bool:
        try:
            found.update({r["id"]: r for r in client.poll("batch", max=100, wait_s=1)})
        except ClientError as exc:  # the ledger still recovering: 503, try again
            if exc.status != 503:
                raise
        return len(found) >= 3

    wait_for(offered, 30, "the accepted results after the restart")
    assert set(found) == {first, answers[1], answers[4]}
    assert found[answers[1]]["result"] == {"n": 1} and found[answers[1]]["key"] == b.key
    assert found[answers[4]]["result"] == b"\x00\xffbytes"
    assert client.ack("batch", sorted(found)) == 3
    client.close()
    assert node.stop() == 0
