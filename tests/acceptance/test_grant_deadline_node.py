"""Acceptance: a running node stops granting the moment its grant deadline
passes, and grants again once it is extended (docs/fleet.md).

The deadline is the ready set's ``grant_until`` (CLOCK_MONOTONIC ns), which a
fleet node's membership heartbeat extends; here the test writes it itself
(``ReadySet.set_grant_until``), as a heartbeat would. Two claimers run against
the node at once: ``POST /claim`` (an HTTP worker, the C claim path) and a
``LocalClaimer`` in a child process (spawned: its own mapping of the
segments). Each claim is timed on the same system-wide monotonic clock as
the deadline: a claim that started at or after the deadline must be refused
(503 ``not_granting``), a claim that ended before it must grant, and once
refused, every claim is refused until the deadline moves.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest

from node.client import LocalClaimer
from node.core.errors import ClientError
from node.core.rows import RowWrite
from node.store import open_store
from node.testing import NodeProcess, finish, wait_for
from shm.ready import ReadySet

pytestmark = pytest.mark.timeout(120)

SPAWN = multiprocessing.get_context("spawn")
ROWS = 3000
S = 1_000_000_000  # ns


@pytest.fixture
def node(tmp_path, node_name):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    store = open_store(f"sqlite:///{data_dir / 'schedule.db'}")
    now = time.time()
    store.upsert(
        [RowWrite(key=f"k{i:05d}", route="r", due_at=now - 600 - i) for i in range(ROWS)], now=now
    )
    store.close()
    proc = NodeProcess(data_dir, node_name)
    proc.start()
    yield proc
    finish([proc], node_name)


def _local_claims(name: str, data_dir: str, conn: Any) -> None:
    """A child: one claim of one lease per request on ``conn``, answered
    ``(granted leases or the refusal's (status, code), started_ns, ended_ns)``."""
    with LocalClaimer(name, data_dir=data_dir, consumer="child") as local:
        conn.send("attached")
        while conn.recv():
            started = time.monotonic_ns()
            try:
                answer: Any = len(local.claim(1, lease_s=3600))
            except ClientError as exc:
                answer = (exc.status, exc.code)
            conn.send((answer, started, time.monotonic_ns()))


class Claims:
    """Both claimers, one claim each per ``round()``."""

    def __init__(self, node: NodeProcess, conn: Any) -> None:
        self.node = node
        self.conn = conn

    def http(self) -> tuple[Any, int, int]:
        started = time.monotonic_ns()
        status, body = self.node.request(
            "POST", "/claim", {"max": 1, "consumer": "http", "lease_s": 3600}
        )
        ended = time.monotonic_ns()
        if status == 200:
            return len(body["leases"]), started, ended
        return (status, body["error"]["code"]), started, ended

    def local(self) -> tuple[Any, int, int]:
        self.conn.send(True)
        assert self.conn.poll(30), "the child's LocalClaimer did not answer"
        return self.conn.recv()

    def round(self) -> list[tuple[Any, int, int]]:
        return [self.http(), self.local()]


def _check_around(claims: Claims, until: int) -> None:
    """Claim until both claimers are refused (the deadline ``until`` must pass
    within a few seconds): grants before it, refusals from it on."""
    refused = set()
    granted_before = 0
    give_up = time.monotonic_ns() + 20 * S
    while len(refused) < 2:
        assert time.monotonic_ns() < give_up, "the claims were never refused"
        for side, (answer, started, ended) in enumerate(claims.round()):
            if answer == (503, "not_granting"):
                assert ended >= until, f"refused {(until - ended) / 1e6:.3f} ms before the deadline"
                refused.add(side)
            else:
                assert answer == 1, answer
                assert side not in refused, "granted again after a refusal, the deadline unmoved"
                assert started < until, (
                    f"granted {(started - until) / 1e6:.3f} ms after the deadline"
                )
                granted_before += ended < until
    assert granted_before, "nothing was granted before the deadline"


def test_claims_stop_at_the_deadline_and_resume_when_it_is_extended(node):
    parent, child_end = SPAWN.Pipe()
    child = SPAWN.Process(
        target=_local_claims, args=(node.name, str(node.data_dir), child_end), daemon=True
    )
    child.start()
    ready = ReadySet.attach(node.name)
    try:
        assert parent.poll(30) and parent.recv() == "attached"
        claims = Claims(node, parent)
        assert ready.grant_until_ns == 0  # a single node: no deadline
        assert [answer for answer, _, _ in claims.round()] == [1, 1]

        # A deadline already past: nothing is granted, and nothing is taken.
        ready.set_grant_until(time.monotonic_ns() - 1)
        left = ready.remaining()
        assert [answer for answer, _, _ in claims.round()] == [(503, "not_granting")] * 2
        assert ready.remaining() == left

        # Extended, as a heartbeat does: granting again at once.
        ready.set_grant_until(time.monotonic_ns() + 60 * S)
        assert [answer for answer, _, _ in claims.round()] == [1, 1]

        # A deadline that passes while the claimers claim.
        until = time.monotonic_ns() + S // 2
        ready.set_grant_until(until)
        _check_around(claims, until)

        # Extended again, then lifted (0): granting.
        ready.set_grant_until(time.monotonic_ns() + 60 * S)
        assert [answer for answer, _, _ in claims.round()] == [1, 1]
        ready.set_grant_until(0)
        assert [answer for answer, _, _ in claims.round()] == [1, 1]
    finally:
        ready.close()
        parent.send(False)
        child.join(30)
    assert child.exitcode == 0
    status, accounting = node.request("GET", "/accounting")
    assert status == 200 and accounting["routed"] == accounting["in_flight"]
    wait_for(lambda: node.request("GET", "/accounting")[1]["balanced"], 20, "a balanced ledger")
    assert node.stop() == 0


def test_the_node_refuses_a_ready_set_of_the_layout_before_the_deadline(node):
    """A claimer built before the grant deadline (ready-set layout 4) would not
    check it: it is refused at attach, never left to grant past a deadline."""
    from node.core.errors import LayoutMismatch
    from node.core.names import shm_segment_name
    from shm import segment

    with pytest.raises(LayoutMismatch):
        segment.attach(shm_segment_name(node.name, "ready"), 4).close()
