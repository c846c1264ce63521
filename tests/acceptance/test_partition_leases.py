"""Acceptance: leases held across a partition (issue 19, item 5;
docs/reliability.md, "Partitions").

Node A grants 20 leases, then is cut off from the database with them live.
Once A lapses, B owns every row: it cannot see A's lease table, so it grants
those 20 keys too (the window docs/delivery.md, "Two nodes, one key",
names), completes 12 of them (those items run twice) and releases 8.
Healed, A comes back under the same live list it last read, and counts the
lapse as the two membership changes it was (keeper/owned.py): its leases
fenced, its rows dropped and walked in again. A's holders hand in 8
results, each accepted once and delivered, its write-back losing where B
ran the key, release 8 and keep 4 in flight. Every result of both nodes is polled and acked
through one node; every row ends with exactly one keeper, and both ledger
laws balance on each node and for the fleet (before the lapse was counted
so, A's input law was off by its leases that B ran).
"""

from __future__ import annotations

import time

import psycopg
import pytest

from node.core.ids import number_of
from node.testing import NodeProcess, wait_for
from tests.acceptance.test_partition import (  # noqa: F401 - fleet is a fixture
    KEYS,
    LAWS,
    _exact,
    _get,
    _held,
    _laws,
    _live_in_db,
    _post,
    fleet,
)

pytestmark = pytest.mark.timeout(180)

HELD = 20


def _due_keys(pg_url: str) -> set[str]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute("SELECT key FROM schedule WHERE due_at <= extract(epoch FROM now())")
        return {row[0] for row in rows}


def _claim_all(node: NodeProcess) -> list[dict]:
    leases: list[dict] = []
    while True:
        status, body = _post(node, "/claim", {"max": 100, "consumer": "b", "lease_s": 600})
        assert status == 200, (status, body)
        if not body["leases"]:
            return leases
        leases += body["leases"]


def _complete(node: NodeProcess, leases: list[dict]) -> list[dict]:
    """Every lease's result in one request, answered at once: after the
    heal the ledger's first read of the store runs on a connection the cut
    closed, and is run again on a new one (it was a 503 here)."""
    items = [{"lease_id": x["lease_id"], "key": x["key"], "result": {"ok": 1}} for x in leases]
    status, body = _post(node, "/complete", {"items": items})
    assert status == 200, (status, body)
    return body["items"]


def _poll_and_ack_all(node: NodeProcess, expected: int) -> list[dict]:
    """Every result of the fleet, polled and acked through ``node``."""
    got: list[dict] = []

    def more() -> bool:
        status, body = _get(node, "/jobs/default/results?scope=cluster&max=1000")
        assert status == 200, (status, body)
        fresh = body["results"]
        if fresh:
            ids = [r["id"] for r in fresh]
            status, acked = _post(node, "/jobs/default/ack", {"ids": ids})
            assert status == 200, (status, acked)
            got.extend(fresh)
        return len(got) >= expected

    wait_for(more, 30, f"{expected} results polled and acked")
    return got


def _release(node: NodeProcess, leases: list[dict]) -> None:
    for lease in leases:
        status, body = _post(node, "/release", {"lease_id": lease["lease_id"], "key": lease["key"]})
        assert status == 200, (status, body)


def test_leases_held_across_a_cut_from_the_database(pg_url, net, fleet):  # noqa: F811
    """A's 20 leases: B runs 12 of their keys while A is out and releases
    the other 8 (they stay due). Healed, A completes 4 of those B left and
    4 it ran, releases 4 of each, and keeps 4 it ran in flight: every
    outcome of a lease that crossed a lapse, on a key held by the node
    again. (Before the lapse was counted, A's input law was off by the
    released and the kept leases on keys B ran.)"""
    hosts, a, b = fleet
    status, body = _post(a, "/claim", {"max": HELD, "consumer": "a", "lease_s": 600})
    assert status == 200 and len(body["leases"]) == HELD, (status, body)
    held = body["leases"]
    # And 4 whose leases expire during the cut (a holder slower than its
    # lease): B runs those keys too, and A's holders hand the results in
    # late after the heal, accepted (the key not granted on A since).
    status, body = _post(a, "/claim", {"max": 4, "consumer": "a", "lease_s": 1})
    assert status == 200 and len(body["leases"]) == 4, (status, body)
    expired = body["leases"]
    left_done, left_released = held[:4], held[4:8]
    ran_done, ran_released, ran_kept = held[8:12], held[12:16], held[16:]
    ran = ran_done + ran_released + ran_kept
    keys_of = lambda leases: {lease["key"] for lease in leases}  # noqa: E731

    net.cut(hosts[0], net.db)
    wait_for(lambda: not _live_in_db(pg_url, a.name), 15, "a out of the live list")
    wait_for(lambda: _exact([b], KEYS, _due_keys(pg_url)), 60, "b alone exact, holding every row")
    taken = _claim_all(b)
    assert keys_of(held + expired) <= keys_of(taken)  # a's leases are invisible to b
    b_left = [lease for lease in taken if lease["key"] in keys_of(held[:8])]
    b_ran = [lease for lease in taken if lease["key"] not in keys_of(held[:8])]
    _release(b, b_left)
    b_outcomes = _complete(b, b_ran)
    assert all(o["outcome"] == "ok" for o in b_outcomes), b_outcomes
    b_number = number_of(b_outcomes[0]["id"])

    net.heal(hosts[0], net.db)
    wait_for(lambda: _exact([a, b], KEYS, _due_keys(pg_url)), 90, "both exact again after the heal")
    a_outcomes = _complete(a, left_done + ran_done + expired)
    assert all(o["outcome"] == "ok" for o in a_outcomes), a_outcomes  # accepted, once (late too)
    a_number = number_of(a_outcomes[0]["id"])
    _release(a, left_released + ran_released)

    # Whose write-back each row kept: b's where it ran the key (a's lost to
    # it, the version guard), a's where b did not; the released ones due.
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = dict(
            (key, (rid, later))
            for key, rid, later in conn.execute(
                "SELECT key, last_result_id, due_at > extract(epoch FROM now())"
                " FROM schedule WHERE key = ANY(%s)",
                (sorted(keys_of(held)),),
            )
        )
    for key in keys_of(ran):
        assert number_of(rows[key][0]) == b_number and rows[key][1], (key, rows[key])
    # (ran_kept: still in flight on a, the rows as b left them.)
    for key in keys_of(left_done):
        assert number_of(rows[key][0]) == a_number and rows[key][1], (key, rows[key])
    for key in keys_of(left_released):
        assert rows[key] == (None, False), (key, rows[key])

    # Every result polled and acked through a: the keys both ran twice.
    results = _poll_and_ack_all(a, len(b_ran) + len(left_done) + len(ran_done) + len(expired))
    per_key: dict[str, int] = {}
    for result in results:
        per_key[result["key"]] = per_key.get(result["key"], 0) + 1
    assert {k for k, n in per_key.items() if n == 2} == keys_of(ran_done + expired), per_key
    assert not keys_of(left_released) & per_key.keys()
    assert len(results) == len(b_ran) + len(left_done) + len(ran_done) + len(expired)

    since = time.time()
    try:
        wait_for(lambda: _laws([a, b], since), 30, "both laws, per node and fleet")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {LAWS}") from None
