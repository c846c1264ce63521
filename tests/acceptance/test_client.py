"""Acceptance: ``node.client.Client`` and ``LocalClaimer`` against a real
``python -m node run`` (keeper, ledger, one HTTP worker as subprocesses).

Waits poll a condition up to a deadline (the keeper publishes a written row
within about a second); nothing sleeps to synchronise.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from node.client import Client, ClientError, LocalClaimer
from node.testing import NodeProcess, finish, wait_for

pytestmark = pytest.mark.timeout(60)

@pytest.fixture
def node(tmp_path, node_name):
    proc = NodeProcess(tmp_path / "data", node_name)
    yield proc
    finish([proc], node_name)


def _rows(keys: list[str], job: str = "j", due_at: float | None = None) -> list[dict]:
    due = time.time() - 3600 if due_at is None else due_at
    return [{"key": k, "route": "r", "due_at": due, "payload": {"k": k}, "job": job} for k in keys]


def _claim_all(claim, n: int, what: str = "claims") -> list:
    """Claim until ``n`` leases came back (the keeper publishes within ~1 s)."""
    got: list = []

    def more() -> bool:
        got.extend(claim())
        return len(got) >= n

    wait_for(more, 20, what)
    return got


@pytest.mark.parametrize("wire", ["msgpack", "json"])
def test_client_claims_renews_releases_and_explains(node, wire):
    node.start()
    client = Client(node.base_url, wire=wire)
    keys = [f"https://example.com/c/{i}" for i in range(5)]
    assert client.upsert(_rows(keys)) == 5
    grants = _claim_all(lambda: client.claim(10, lease_s=120, consumer="gpu-a"), 5)
    assert sorted(g.key for g in grants) == keys
    assert all(g.job == "j" and g.payload == {"k": g.key} for g in grants)
    assert client.claim(10, consumer="gpu-a") == []  # every key is leased
    by_key = {g.key: g for g in grants}

    first, second = by_key[keys[0]], by_key[keys[1]]
    assert client.renew(first.lease_id, first.key, 600) > first.expires_at
    client.release(second.lease_id, second.key, error="cuda oom")
    with pytest.raises(ClientError) as info:
        client.release(second.lease_id, second.key)
    assert (info.value.status, info.value.code) == (409, "lease_ended")
    with pytest.raises(ClientError) as info:
        client.renew(first.lease_id + 10_000, first.key, 60)
    assert (info.value.status, info.value.code) == (409, "lease_unknown")
    with pytest.raises(ClientError) as info:
        client.claim(0)
    assert (info.value.status, info.value.code, info.value.field) == (400, "invalid_max", "max")

    assert sorted(x["key"] for x in client.leases()) == sorted(set(keys) - {second.key})
    (held,) = client.held()
    assert held["key"] == second.key and held["last_error"] == "cuda oom"
    explained = client.row(second.key)["lease"]
    assert explained["state"] == "held" and explained["why_not"].startswith("held until")
    assert client.row(first.key)["lease"]["why_not"] == "leased"
    assert client.unhold([second.key]) == 1
    assert client.held() == []
    # Unheld, the key is offered again at the keeper's next publish.
    (again,) = _claim_all(lambda: client.claim(10, consumer="gpu-b"), 1, "the unheld key")
    assert again.key == second.key and again.lease_id > second.lease_id
    client.close()
    assert node.stop() == 0


@pytest.mark.parametrize("wire", ["msgpack", "json"])
def test_client_completes_polls_and_acks(node, wire):
    node.start()
    client = Client(node.base_url, wire=wire)
    keys = ["a/1", "a/2", "a/3"]
    client.upsert(_rows(keys, job="render"))
    grants = {g.key: g for g in _claim_all(lambda: client.claim(3, consumer="w"), 3)}
    rid1 = client.complete(grants["a/1"].lease_id, "a/1", {"html": "<p>"})
    rid2 = client.complete(grants["a/2"].lease_id, "a/2", b"\x00\xffpng")
    # A repeat is 200 again (the ledger names the id when it still knows it).
    assert client.complete(grants["a/1"].lease_id, "a/1", {"html": "<p>"}) in (rid1, None)
    with pytest.raises(ClientError) as info:
        client.complete(grants["a/3"].lease_id + 10_000, "a/3", 1)
    assert (info.value.status, info.value.code) == (409, "lease_unknown")
    # complete_many takes an item as a tuple or as the HTTP form's object
    [refused] = client.complete_many([{"lease_id": grants["a/3"].lease_id + 1, "key": "a/3",
                                       "result": 1}])  # fmt: skip
    assert isinstance(refused, ClientError) and refused.code == "lease_unknown"
    with pytest.raises(ClientError) as info:
        client.complete_many([{"lease_id": grants["a/3"].lease_id, "key": "a/3"}])
    error = info.value
    assert (error.status, error.code, error.field) == (400, "invalid_body", "items[0]")

    results = {r["id"]: r for r in client.poll("render", max=10, wait_s=5)}
    assert set(results) == {rid1, rid2}
    assert results[rid1]["result"] == {"html": "<p>"} and results[rid1]["key"] == "a/1"
    assert results[rid2]["result"] == b"\x00\xffpng"
    assert client.poll("other") == []
    with pytest.raises(ClientError) as info:
        client.ack("render", [rid1, 987_654_321])
    assert (info.value.status, info.value.code) == (409, "never_offered")
    assert client.ack("render", [rid1, rid2]) == 2
    assert client.ack("render", [rid1]) in (0, 1)  # idempotent: 200 again

    # The completed rows were written back with their next due time.
    row = client.row("a/1")["row"]
    assert row["due_at"] > time.time() + 3000
    counts = client.accounting()
    assert counts["routed"] >= 3 and counts["finished"] == 2
    client.close()
    assert node.stop() == 0


def test_local_claimer_claims_from_shared_memory(node):
    node.start()
    client = Client(node.base_url)
    keys = [f"local/{i}" for i in range(4)]
    client.upsert(_rows(keys, job="emb"))
    with LocalClaimer(node.name, data_dir=node.data_dir, consumer="gpu0") as local:
        grants = _claim_all(lambda: local.claim(2, lease_s=90, wait_s=2), 4, "local claims")
        assert sorted(g.key for g in grants) == keys
        assert {x["consumer"] for x in client.leases()} == {"gpu0"}
        first, second, third, _ = grants
        rid = local.complete(first.lease_id, first.key, [1.0, 2.0])
        assert local.renew(second.lease_id, second.key, 300) > time.time() + 200
        local.release(third.lease_id, third.key, error="bad input")
        with pytest.raises(ClientError) as info:
            local.release(third.lease_id, third.key)
        assert (info.value.status, info.value.code) == (409, "lease_ended")
        with pytest.raises(ClientError) as info:
            local.complete(second.lease_id + 10_000, second.key, 1)
        assert (info.value.status, info.value.code) == (409, "lease_unknown")
        with pytest.raises(ClientError) as info:
            local.claim(5, lease_s=0)
        assert info.value.code == "invalid_lease_s"
        many = local.complete_many(
            [(second.lease_id, second.key, b"raw"), {"lease_id": 1, "key": "nope", "result": 1}]
        )
        assert isinstance(many[0], int) and many[1].code == "lease_unknown"
    results = {r["id"]: r for r in client.poll("emb", wait_s=5)}
    assert results[rid]["result"] == [1.0, 2.0]
    assert results[many[0]]["result"] == b"raw"
    client.close()
    assert node.stop() == 0


def test_local_claimer_finds_its_node_by_name_and_says_node_restarted_while_it_is_down(
    tmp_path, node_name, monkeypatch
):
    """``LocalClaimer(name)`` alone finds a node whose data directory is
    neither ``./node-data`` nor named by a variable, given to the node
    relative to its own directory (through the running node). While the node
    is stopped every call says ``node_restarted``, whichever came first; once
    it is back the saved lease completes."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    monkeypatch.delenv("QUEUE_NODE_DATA_DIR", raising=False)
    monkeypatch.delenv("QUEUE_NODE_RUN_CONFIG", raising=False)
    monkeypatch.chdir(home)
    node = NodeProcess(Path("rel-data"), node_name, cwd=home)

    def at_home(step):  # the harness reads the node's files by the relative path
        monkeypatch.chdir(home)
        try:
            return step()
        finally:
            monkeypatch.chdir(elsewhere)  # no ./node-data, no ./rel-data here

    try:
        at_home(node.start)
        client = Client(node.base_url)
        client.upsert(_rows(["down/1", "down/2"]))
        with LocalClaimer(node.name) as local:
            first, second = _claim_all(lambda: local.claim(2, lease_s=300, wait_s=2), 2)
            assert at_home(node.stop) == 0
            with pytest.raises(ClientError) as info:
                local.renew(first.lease_id, first.key, 300)
            assert (info.value.status, info.value.code) == (503, "node_restarted")
            with pytest.raises(ClientError) as info:
                local.complete(second.lease_id, second.key, 1)
            assert (info.value.status, info.value.code) == (503, "node_restarted")
            client.close()
            at_home(node.start)
            client = Client(node.base_url)
            rid = local.complete(second.lease_id, second.key, 2)
            # reattached (found again by its name) for a lease change
            assert local.renew(first.lease_id, first.key, 300) > time.time() + 200
        assert [r["id"] for r in client.poll("j", wait_s=5)] == [rid]
        client.close()
    finally:
        monkeypatch.chdir(home)
        finish([node], node_name)


def test_local_claimer_names_where_it_looked(tmp_path):
    from node.core.errors import NodeNotRunning

    with pytest.raises(NodeNotRunning, match="no run configuration"):
        LocalClaimer("no-such-node", data_dir=tmp_path)


def test_client_unreachable_is_a_client_error():
    client = Client("http://127.0.0.1:9")
    with pytest.raises(ClientError) as info:
        client.claim(1)
    assert (info.value.status, info.value.code) == (0, "unreachable")
