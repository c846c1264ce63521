"""Acceptance: two nodes never grant one key at once when a node joins
(issue 18, item 3; docs/delivery.md, "Two nodes, one key"). The first
node's keeper is stopped (SIGSTOP) just before the second joins, so it
cannot read the new list: its HTTP workers go on granting from the set it
published until its grant deadline passes, and it is claimed from one key
at a time all along. The joining node holds back until no other node can be
granting its rows: no key the second granted was granted by the first after
it (by the test's clock: the first's grant comes after its request was
sent, the second's before its answer came), and the joining node answered
/readyz 503 meanwhile. Without the hold the second grants its share about
3 s after it starts, while the first grants for 6 s.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import psycopg
import pytest

from node.store.postgres import PostgresStore
from node.testing import NodeProcess, finish, wait_for
from tests import pg

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 8.0  # the deadline is 6.4 s after a heartbeat


def _published(node: NodeProcess) -> bool:
    """The node's keeper has published its set of the 300 rows."""
    from shm.ready import ReadySet

    ready = ReadySet.attach(node.name)
    try:
        return len(ready.snapshot().entries) == 300
    finally:
        ready.close()


def _joining(node: NodeProcess) -> tuple[int, dict] | None:
    """/readyz's answer once it says the node holds back as it joins."""
    try:
        status, body = node.request("GET", "/readyz", timeout_s=5)
    except OSError:  # not listening yet
        return None
    joining = isinstance(body, dict) and "joining the fleet" in body.get("reason", "")
    return (status, body) if joining else None


class Claims(threading.Thread):
    """Claims from one node until stopped (leases of 600 s: a key granted
    stays leased); records each key's grants as (sent, answered) on the
    monotonic clock."""

    def __init__(self, node: NodeProcess, max_n: int, pace_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.node = node
        self.max_n = max_n
        self.pace_s = pace_s
        self.refused = 0
        self.stop = threading.Event()
        self.grants: dict[str, list[tuple[float, float]]] = {}
        self.errors: list[object] = []
        self.requests = 0

    def run(self) -> None:
        while not self.stop.is_set():
            sent = time.monotonic()
            try:
                status, body = self.node.request(
                    "POST", "/claim", {"max": self.max_n, "consumer": "t", "lease_s": 600}
                )
            except OSError as exc:  # not listening yet
                self.errors.append(exc)
                self.stop.wait(0.05)
                continue
            answered = time.monotonic()
            self.requests += 1
            if status != 200:
                self.refused += 1
                self.errors.append(body)
                self.stop.wait(0.05)  # a node not granting (yet): ask again shortly
                continue
            for lease in body["leases"]:
                self.grants.setdefault(lease["key"], []).append((sent, answered))
            self.stop.wait(self.pace_s if body["leases"] else 0.02)


def test_a_joining_node_grants_no_key_the_other_may_still_grant(tmp_path, pg_url):
    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at)"
            " SELECT 'k' || i, 'r', 86400, %s FROM generate_series(1, 300) AS i",
            (time.time() - 3600,),
        )
    names = sorted(f"h-{uuid.uuid4().hex[:10]}" for _ in range(2))
    env = {"QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": str(TIMEOUT_S), "QUEUE_NODE_HEARTBEAT_S": "0.2"}
    first = NodeProcess(tmp_path / names[0], names[0], "--store", pg_url, env=env)
    second = NodeProcess(tmp_path / names[1], names[1], "--store", pg_url, env=env)
    on_first = Claims(first, 1, pace_s=0.02)  # one key at a time: it grants for seconds
    on_second = Claims(second, 64)
    keeper = 0
    try:
        first.start()
        wait_for(lambda: _published(first), 30, "the first node's set of every row")
        keeper = first.pids()["keeper"]
        os.kill(keeper, signal.SIGSTOP)
        stopped_at = time.monotonic()
        on_first.start()
        second.start(wait_ready=False)
        on_second.start()
        status, body = wait_for(lambda: _joining(second), 30, "the joining node holding back")
        assert status == 503, body
        wait_for(lambda: on_first.refused, 30, "the first node's deadline passed")
        deadline_s = time.monotonic() - stopped_at
        wait_for(lambda: len(on_second.grants) >= 50, 60, "the second node grants its share")
    finally:
        if keeper:
            os.kill(keeper, signal.SIGCONT)
        for claims in (on_first, on_second):
            claims.stop.set()
            if claims.is_alive():
                claims.join(10)
        finish([first], names[0])
        finish([second], names[1])
    assert len(on_first.grants) > 100, "the first node granted all along"
    # One key granted by both at once: the second's answered before the
    # first's was even sent.
    both = {}
    for key, second_grants in on_second.grants.items():
        second_at = min(a for _s, a in second_grants)
        first_at = max((s for s, _a in on_first.grants.get(key, [])), default=0.0)
        if second_at < first_at:
            both[key] = round(first_at - second_at, 3)
    assert not both, f"granted by both nodes at once (s the first granted after): {both}"
    assert deadline_s <= TIMEOUT_S
