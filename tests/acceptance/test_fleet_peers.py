"""Acceptance: a fleet node that names ``peers`` publishes nothing until it
sees one of them live, or ``peer_wait_s`` passes, and then publishes alone
and says so in ``trust.membership.peers`` and its log; a node alone does not
wait (issue 18, item 2; docs/fleet.md, "Waiting for peers")."""

from __future__ import annotations

import time
import uuid

import pytest

from node.store.postgres import PostgresStore
from node.testing import NodeProcess, finish, wait_for
from tests import pg

pytestmark = pytest.mark.timeout(180)

FLEET_ENV = {"QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": "3", "QUEUE_NODE_HEARTBEAT_S": "0.2"}


def _peers(node: NodeProcess) -> dict:
    from shm.state import read_state

    try:
        member = (read_state(node.name).get("trust") or {}).get("membership") or {}
    except Exception:  # noqa: BLE001 - not written yet
        return {}
    return member.get("peers") or {}


def _answers(node: NodeProcess) -> bool:
    """Whether the node's HTTP workers answer /readyz (200 or 503)."""
    try:
        return node.request("GET", "/readyz", timeout_s=5)[0] in (200, 503)
    except OSError:  # not listening yet, or the ledger's 2 s question pending
        return False


def _leases(node: NodeProcess) -> list:
    status, doc = node.request("POST", "/claim", {"max": 50, "consumer": "t", "lease_s": 600})
    return doc.get("leases") or [] if status == 200 else []


def _due_rows(node: NodeProcess, n: int) -> None:
    rows = [{"key": f"k{i}", "route": "r", "cadence_s": 3600, "due_at": time.time() - 60}
            for i in range(n)]  # fmt: skip
    assert node.request("POST", "/rows", rows) == (200, {"upserted": n})


def test_a_node_with_peers_waits_for_one_before_it_publishes_and_one_alone_does_not(
    tmp_path, pg_url
):
    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    a_name, b_name = (f"t-{uuid.uuid4().hex[:10]}" for _ in range(2))
    waiting = NodeProcess(tmp_path / a_name, a_name, "--store", pg_url,
                          env={**FLEET_ENV, "QUEUE_NODE_PEERS": b_name,
                               "QUEUE_NODE_PEER_WAIT_S": "120"})  # fmt: skip
    peer = NodeProcess(tmp_path / b_name, b_name, "--store", pg_url, env=FLEET_ENV)
    try:
        waiting.start(wait_ready=False)
        wait_for(lambda: _answers(waiting), 30, "the node answers")
        _due_rows(waiting, 200)
        wait_for(lambda: _peers(waiting).get("state") == "waiting", 30, "waiting for its peer")
        # Its keeper is live and holds the due rows, and offers none of them.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # sampled over two seconds of the wait
            assert _leases(waiting) == []
            time.sleep(0.1)  # a sampling interval, not a synchronisation
        assert _peers(waiting)["state"] == "waiting"
        status, body = waiting.request("GET", "/readyz")
        assert status == 503 and "waiting for its fleet peers" in body["reason"], body

        # The peer comes (alone in its configuration: it does not wait).
        peer.start()
        wait_for(lambda: _peers(peer).get("state") == "none", 30, "the peer's state")
        wait_for(lambda: _peers(waiting).get("state") == "seen", 30, "the peer seen")
        assert 0 < _peers(waiting)["waited_s"] < 120
        wait_for(lambda: _leases(waiting), 30, "a grant once the peer is seen")
        wait_for(lambda: waiting.request("GET", "/readyz")[0] == 200, 10, "ready")
        assert "fleet_peer_seen" in waiting.log_path.read_text()
    finally:
        finish([waiting, peer], a_name)
        finish([], b_name)


def test_a_node_whose_peers_never_come_publishes_alone_after_the_wait_and_says_so(
    tmp_path, node_name, pg_url
):
    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    node = NodeProcess(tmp_path / "data", node_name, "--store", pg_url,
                       env={**FLEET_ENV, "QUEUE_NODE_PEERS": "nobody-here",
                            "QUEUE_NODE_PEER_WAIT_S": "3"})  # fmt: skip
    try:
        node.start()
        _due_rows(node, 20)
        wait_for(lambda: _leases(node), 30, "a grant after the wait")
        peers = wait_for(lambda: (p := _peers(node)).get("state") == "alone" and p, 30,
                         "alone in trust")  # fmt: skip
        assert peers["state"] == "alone" and peers["names"] == ["nobody-here"], peers
        assert peers["waited_s"] >= 3
        assert "fleet_no_peer" in node.log_path.read_text()
    finally:
        finish([node], node_name)
