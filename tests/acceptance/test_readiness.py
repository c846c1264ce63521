"""``GET /readyz`` means the node can take a claim and its completion.

After a restart the keeper can publish before the ledger listens: the
ledger recovers its log first, and only then opens its socket. A readiness
that spoke for the keeper alone answered 200 in that window, and a
completion sent right after it was 503 ``ledger_unavailable``. Here the
ledger's start is slowed on purpose (the ``QUEUE_NODE_TEST_LEDGER_START_DELAY_S``
test hook: a long recovery) so the window is seconds wide, and a completion
sent at once after readyz 200 must be taken: after a kill -9 of the whole
node, and after a kill -9 of the ledger alone (readyz goes 503 meanwhile).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from node.testing import NodeProcess, finish, wait_for

# Seconds the ledger sleeps before recovering: far longer than the keeper
# takes to publish, so readyz must wait for the ledger to say 200.
LEDGER_DELAY_S = "2"


def _claim_and_complete(node: NodeProcess) -> None:
    """One claim (the keeper publishes a write within its interval) and its
    completion, sent at once."""

    def claim() -> dict | None:
        status, body = node.request("POST", "/claim", {"max": 1, "consumer": "t", "lease_s": 300})
        assert status == 200, (status, body)
        return body["leases"][0] if body["leases"] else None

    lease = wait_for(claim, 20, "a lease")
    status, body = node.request(
        "POST", "/complete", {"lease_id": lease["lease_id"], "key": lease["key"], "result": 1}
    )
    assert status == 200, (status, body)


@pytest.mark.timeout(120)
def test_readyz_waits_for_the_ledger_after_a_kill(tmp_path: Path, node_name: str) -> None:
    data = tmp_path / "data"
    env = {"QUEUE_NODE_TEST_LEDGER_START_DELAY_S": LEDGER_DELAY_S}
    node = NodeProcess(data, node_name, env=env)
    nodes = [node]
    try:
        node.start()
        rows = [{"key": f"k{i}", "route": "r", "cadence_s": 86400, "due_at": 0} for i in range(20)]
        assert node.request("POST", "/rows", rows)[0] == 200
        _claim_and_complete(node)

        # 1. kill -9 of the whole node: everything starts at once again.
        node.kill()
        node = NodeProcess(data, node_name, env=env)
        nodes.append(node)
        node.start()  # returns at readyz 200
        _claim_and_complete(node)

        # 2. kill -9 of the ledger alone: not ready until it answers again.
        ledger = node.pids_by_role()["ledger"]
        os.kill(ledger, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: node.request("GET", "/readyz")[0] == 503, 10, "readyz 503")
        node.wait_ready(60)
        assert node.pids_by_role()["ledger"] != ledger
        assert time.monotonic() - killed_at >= float(LEDGER_DELAY_S)
        _claim_and_complete(node)
        assert node.stop() == 0
    finally:
        finish(nodes, node_name)
