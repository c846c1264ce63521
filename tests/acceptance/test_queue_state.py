"""GET /queue-state and shm.state.read_state: the numbers are exact.

The acceptance test seeds a schedule (rows loaded from the SQLite file at
start, rows posted, rows an outside program writes), leases and holds some of
them through the HTTP API, and compares every group of the answer with a
brute-force count over the table read straight from SQLite, at the counts'
own time (``now.at``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import sqlite3
import time
from collections import Counter, defaultdict
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from node.client import Client
from node.config import Config
from node.core.rows import parse_row
from node.store import open_store
from node.testing import NodeProcess, finish, wait_for
from shm.leases import CODE_NAMES, EMPTY, LEASED, UPDATING, LeaseTable, _mask
from shm.state import queue_state, read_state
from workers.http.app import WorkerContext, make_app
from workers.http.state import routes as state_routes

# The node's configuration: two configured routes, one that takes [defaults].
CONFIG = """
lease_s = 3600
max_misses = 5

[defaults]
cadence_s = 86400
sitemap_boost = 0.5

[routes.news]
cadence_s = 3600
sitemap_boost = 0.25

[routes.shop]
cadence_s = 604800
sitemap_boost = 1.0
"""
ROUTE_CADENCE = {"news": 3600, "shop": 604800}
DEFAULT_CADENCE = 86400
EDGES = [0, 0.25, 0.5, 1, 2, 4]
DAY = 86400.0


# -- LeaseTable.code_counts ----------------------------------------------------------


@pytest.fixture
def table(node_name):
    t = LeaseTable.create(node_name, capacity=64, max_misses=2)
    yield t
    t.close()
    LeaseTable.unlink(node_name)


def _python_counts(t: LeaseTable) -> dict[str, int]:
    """Slots per state the slow way: the keyed states through ``_scan`` (a
    slot mid-change as what it was), the others from the raw words."""
    out = {name: 0 for name in CODE_NAMES}
    for code, name in enumerate(CODE_NAMES):
        if code == UPDATING:
            continue
        if (1 << code) & _mask(4, 5, 6, 7):
            out[name] = sum(1 for _ in t._scan(_mask(code)))
        else:
            out[name] = sum(1 for i in range(t.capacity) if t._state(i) & 15 == code)
    return out


def test_code_counts_match_the_python_scan(table):
    now = 1_000_000.0
    leases = {k: table.grant(k, "t", 10, now, 3600) for k in "abcdefgh"}
    for k in "cd":  # released with an error: held
        assert table.release(k, leases[k].lease_id, now + 1, "boom").value == "released"
    for k in "ef":  # completed: idle
        assert table.complete(k, leases[k].lease_id, now + 1).value == "completed"
    # g misses twice (max_misses 2): parked.
    table.release("g", leases["g"].lease_id, now + 1, "once")
    again = table.grant("g", "t", 10, now + 10_000, 3600)
    table.release("g", again.lease_id, now + 10_001, "twice")
    got = table.code_counts()
    assert got == _python_counts(table)
    assert (got["leased"], got["held"], got["parked"], got["idle"]) == (3, 2, 1, 2)
    assert sum(got.values()) == table.capacity
    assert got["empty"] == table.capacity - 8

    # A slot held mid-change counts as what it was (leased), as _scan reads it.
    idx = next(i for i in range(table.capacity) if table._state(i) & 15 == LEASED)
    own = table._take(idx, table._state(idx))
    assert own is not None and own & 15 == UPDATING
    try:
        assert table.code_counts() == got == _python_counts(table)
    finally:
        table._rollback(idx, own)
    assert table.code_counts() == got
    assert EMPTY == 0


# -- the shared builder, without a node ----------------------------------------------


def _state(doc: dict, **header: Any) -> dict:
    """A StateBuffer.read() of a live keeper (this process) at 1000."""
    state = {
        "status": "live", "exact": True, "phase": "serving", "heartbeat_at": 1000.0,
        "published_at": 1000.0, "first_publish_at": 900.0, "started_at": 800.0,
        "counts_at": 1000.0, "generation": 7, "writer_pid": os.getpid(),
        "counts_writer": {"pid": os.getpid(), "exact": True}, "owner_pid": os.getpid(), "doc": doc,
    }  # fmt: skip
    state.update(header)
    return state


DOC = {
    "now": {"due": {"sitemap": 4, "discovered": 6, "total": 10}, "rows": 30, "classes": 3,
            "paused": ["b", "a"], "paused_node": False},
    "coming": {"15m": 1, "60m": 2, "24h": 5, "by_hour": [2, 3] + [0] * 22},
    "lateness": {"edges": EDGES, "total": [10, 0, 0, 0, 0, 0]},
    "classes": [{"route": "a", "cadence_s": 60, "source": "row", "sitemap": False}],
    "classes_truncated": True,
    "flow": {"minutes": [], "last_hour": {"came_due": 0}},
    "counters": {"received": 12},
    "trust": {"verify": {"repairs": 3, "repairs_membership": 1, "repairs_feed_missed": 2}},
}  # fmt: skip


def test_queue_state_groups_from_a_document_and_lease_counts():
    counts = dict.fromkeys(CODE_NAMES, 0) | {"leased": 3, "held": 2, "parked": 1}
    got = queue_state(_state(DOC), 1001.0, counts)
    assert got["now"] == {
        "due": DOC["now"]["due"], "rows": 30, "classes": 3, "at": 1000.0,
        "in_flight": 3, "held": 2, "parked": 1, "unclaimed": 4,
        "paused": {"node": False, "routes": ["a", "b"]}, "status": "live",
    }  # fmt: skip
    assert got["coming"] == DOC["coming"] and got["lateness"] == DOC["lateness"]
    assert got["classes"] == {"rows": DOC["classes"], "truncated": True}
    assert got["counters"] == {"received": 12} and got["flow"] == DOC["flow"]
    trust = got["trust"]
    assert trust["vouched"] is True and trust["live"] is True and trust["reason"] is None
    assert trust["repairs"] == {"total": 3, "membership": 1, "feed_missed": 2, "top": 0}
    assert (trust["state_age_s"], trust["heartbeat_age_s"]) == (1.0, 1.0)
    # The estimate never goes below zero.
    many = counts | {"leased": 50}
    assert queue_state(_state(DOC), 1001.0, many)["now"]["unclaimed"] == 0
    # No lease table: no lease figures, and no estimate.
    assert queue_state(_state(DOC), 1001.0, None)["now"]["unclaimed"] is None


def test_queue_state_of_a_keeper_that_cannot_vouch_has_no_counts():
    counts = dict.fromkeys(CODE_NAMES, 0) | {"leased": 3}
    got = queue_state(_state(DOC, heartbeat_at=990.0), 1001.0, counts)
    assert set(got) == {"trust", "now"}
    assert got["now"] == {
        "in_flight": 3, "paused": {"node": False, "routes": ["a", "b"]}, "status": "live",
    }  # fmt: skip
    assert got["trust"]["vouched"] is False
    assert got["trust"]["reason"] == "keeper stalled: heartbeat 11.0 s old"


def _ctx(keeper_state: Any, clock: float = 1001.0) -> WorkerContext:
    return WorkerContext(
        config=Config(name="t", workers=1),
        store=open_store("memory://"),
        name="t",
        started_at=800.0,
        keeper_state=keeper_state,
        clock=lambda: clock,
    )


async def _get(ctx: WorkerContext, path: str) -> tuple[int, Any]:
    async with TestClient(TestServer(make_app(ctx, extra_routes=state_routes))) as client:
        resp = await client.get(path)
        return resp.status, await resp.json()


def test_endpoint_scopes_and_a_bad_scope():
    ctx = _ctx(lambda: _state(DOC))
    status, plain = asyncio.run(_get(ctx, "/queue-state"))
    assert status == 200 and plain["now"]["due"]["total"] == 10
    assert plain["now"]["in_flight"] is None  # a worker without the work path
    status, fleet = asyncio.run(_get(ctx, "/queue-state?scope=cluster"))
    assert status == 200
    assert fleet == {**plain, "scope": "cluster", "nodes": ["t"]}
    for bad in ("node", "", "CLUSTER"):
        status, body = asyncio.run(_get(ctx, f"/queue-state?scope={bad}"))
        assert status == 400, body
        assert body["error"]["code"] == "invalid_scope" and body["error"]["field"] == "scope"


def test_endpoint_when_the_buffer_cannot_be_read_is_503():
    def broken() -> dict:
        raise OSError("gone")

    for keeper_state in (broken, lambda: None):
        status, body = asyncio.run(_get(_ctx(keeper_state), "/queue-state"))
        assert status == 503
        assert set(body) == {"trust", "now"}
        assert body["trust"]["vouched"] is False
        assert body["now"] == {
            "in_flight": None, "paused": {"node": False, "routes": []}, "status": None,
        }  # fmt: skip


# -- a real node, counted by brute force ----------------------------------------------


@pytest.fixture
def node(tmp_path, node_name):
    cfg = tmp_path / "node.toml"
    cfg.write_text(CONFIG)
    proc = NodeProcess(
        tmp_path / "data", node_name, "--config", str(cfg),
        env={"QUEUE_NODE_STATE_INTERVAL_S": "0.3"},
    )  # fmt: skip
    yield proc
    finish([proc], node_name)


def _rows(rng: random.Random, prefix: str, n: int, now: float) -> list[dict[str, Any]]:
    """Rows over three routes, route-default and own cadences, both sitemap
    flags; due from four weeks late to three days ahead, a quarter of them
    within the next two hours (the coming windows' edges)."""
    rows = []
    for i in range(n):
        if rng.random() < 0.25:
            offset = rng.uniform(-600, 7200)
        else:
            offset = rng.uniform(-28 * DAY, 3 * DAY)
        row = {
            "key": f"{prefix}-{i}",
            "route": rng.choice(["news", "shop", "blog"]),
            "sitemap": rng.random() < 0.4,
            "due_at": now + offset,
        }
        if rng.random() < 0.5:
            row["cadence_s"] = rng.choice([600, 3600, 86400, 604800])
        rows.append(row)
    return rows


def _table(db) -> list[tuple[str, str, int | None, bool, float]]:
    conn = sqlite3.connect(db)
    try:
        found = conn.execute("SELECT key, route, cadence_s, sitemap, due_at FROM schedule")
        return [(k, r, c, bool(s), float(d)) for k, r, c, s, d in found]
    finally:
        conn.close()


def _max_version(db) -> int:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT max(version) FROM schedule").fetchone()[0]
    finally:
        conn.close()


def _bin(ratio: float) -> int:
    return max(i for i, edge in enumerate(EDGES) if ratio >= edge)


def brute_force(rows, now: float) -> dict[str, Any]:  # noqa: C901 - one pass, every group
    """Every count of the queue-state document, row by row, at ``now``."""
    now_minute = math.floor(now / 60)
    due = Counter()
    coming = {"15m": 0, "60m": 0, "24h": 0, "by_hour": [0] * 24}
    bins = {"sitemap": [0] * 6, "discovered": [0] * 6}
    by_route: dict[str, list[int]] = defaultdict(lambda: [0] * 6)
    classes: dict[tuple, dict[str, Any]] = {}
    for _key, route, cadence_s, sitemap, due_at in rows:
        source = "route" if cadence_s is None else "row"
        cadence = ROUTE_CADENCE.get(route, DEFAULT_CADENCE) if cadence_s is None else cadence_s
        ident = (route, cadence, source, sitemap)
        cls = classes.setdefault(ident, {"rows": 0, "due": 0, "oldest_due_minute": None})
        cls["rows"] += 1
        minute = math.floor(due_at / 60)
        ahead = minute - now_minute
        if ahead > 0:
            coming["15m"] += ahead <= 15
            coming["60m"] += ahead <= 60
            coming["24h"] += ahead <= 1440
            if ahead <= 1440:
                coming["by_hour"][(ahead - 1) // 60] += 1
            continue
        kind = "sitemap" if sitemap else "discovered"
        due[kind] += 1
        cls["due"] += 1
        if cls["oldest_due_minute"] is None or minute < cls["oldest_due_minute"]:
            cls["oldest_due_minute"] = minute
        b = _bin((now - minute * 60) / cadence)
        bins[kind][b] += 1
        by_route[route][b] += 1
    oldest = {}
    for ident, cls in classes.items():
        minute = cls["oldest_due_minute"]
        if minute is not None:
            oldest[ident] = {"due": cls["due"], "oldest_due_minute": minute,
                             "lateness_ratio": (now - minute * 60) / ident[1]}
    return {
        "due": {"sitemap": due["sitemap"], "discovered": due["discovered"],
                "total": due["sitemap"] + due["discovered"]},
        "rows": len(rows),
        "coming": coming,
        "bins": bins,
        "by_route": dict(by_route),
        "classes": classes,
        "oldest": oldest,
    }  # fmt: skip


def claim(node: NodeProcess, n: int) -> list[dict[str, Any]]:
    """Lease ``n`` rows, claiming again until the keeper's publish has them."""
    leases: list[dict[str, Any]] = []

    def granted() -> bool:
        status, body = node.request("POST", "/claim", {"max": n - len(leases), "consumer": "t"})
        assert status == 200, body
        leases.extend(body["leases"])
        return len(leases) >= n

    wait_for(granted, 20, f"{n} leases")
    return leases


def _ident(c: dict[str, Any]) -> tuple:
    return (c["route"], c["cadence_s"], c["source"], c["sitemap"])


def _seed(node: NodeProcess, rng: random.Random, now: float) -> None:
    """Rows in the file before the node starts (the keeper's load walks them)."""
    node.data_dir.mkdir(parents=True)
    store = open_store(f"sqlite:///{node.data_dir}/schedule.db")
    try:
        store.upsert([parse_row(r) for r in _rows(rng, "loaded", 600, now)], now=now)
    finally:
        store.close()


def _exact_state(node: NodeProcess, in_flight: int, held: int) -> dict[str, Any]:
    """A vouched state whose counts were taken after every write was applied."""
    db = node.data_dir / "schedule.db"
    last = _max_version(db)
    written_at = time.time()

    def settled():
        state = read_state(node.name)
        trust, now = state["trust"], state["now"]
        return (
            state
            if trust["vouched"]
            and trust["feed_seq"] >= last
            and now["at"] > written_at
            and (now["in_flight"], now["held"]) == (in_flight, held)
            else False
        )

    return wait_for(settled, 30, "a vouched state after the last write")


@pytest.mark.timeout(180)
def test_every_group_matches_a_brute_force_count(node):
    rng = random.Random(20240611)
    t0 = time.time()
    _seed(node, rng, t0)
    node.start()
    status, body = node.request("POST", "/rows", _rows(rng, "posted", 250, time.time()))
    assert status == 200 and body == {"upserted": 250}
    conn = sqlite3.connect(node.data_dir / "schedule.db")
    with conn:  # an outside program, with a route default and an own cadence
        conn.execute("PRAGMA busy_timeout = 5000")
        for i, (route, cadence, sitemap) in enumerate(
            [("news", None, 1), ("blog", 600, 0), ("shop", None, 0), ("other", 86400, 1)]
        ):
            conn.execute(
                "INSERT INTO schedule (key, route, cadence_s, sitemap, due_at) VALUES (?,?,?,?,?)",
                (f"outside-{i}", route, cadence, sitemap, t0 - (i + 1) * 5000.0),
            )
    conn.close()
    db = node.data_dir / "schedule.db"
    wait_for(lambda: (s := read_state(node.name))["trust"]["vouched"]
             and s["trust"]["feed_seq"] >= _max_version(db), 30, "the keeper caught up")

    leases = claim(node, 7)
    assert len(leases) == 7
    for lease in leases[:3]:
        status, body = node.request(
            "POST", "/release", {"lease_id": lease["lease_id"], "key": lease["key"], "error": "x"}
        )
        assert status == 200, body

    state = _exact_state(node, in_flight=4, held=3)
    rows = _table(db)
    assert len(rows) == 854
    check_against_brute_force(state, rows)
    # Lifetime and per-minute figures: 250 + 4 inserts seen on the feed (the
    # loaded rows are restored, not added), 7 leases granted.
    assert state["flow"]["last_hour"]["added"] == 254
    assert state["flow"]["last_hour"]["triggered"] == 7
    assert len(state["flow"]["minutes"]) <= 60

    # The endpoint answers from the same builder, at its own counts time.
    status, answer = node.request("GET", "/queue-state")
    assert status == 200
    check_against_brute_force(answer, rows)
    assert node.stop() == 0


def check_against_brute_force(state: dict[str, Any], rows: list) -> None:
    want = brute_force(rows, state["now"]["at"])
    now = state["now"]
    assert now["due"] == want["due"]
    assert now["rows"] == want["rows"]
    assert (now["in_flight"], now["held"], now["parked"]) == (4, 3, 0)
    assert now["unclaimed"] == want["due"]["total"] - 7
    assert now["paused"] == {"node": False, "routes": []}
    assert now["status"] in ("live", "verifying")
    assert now["classes"] >= len(want["classes"])
    assert state["coming"] == want["coming"]
    # A few rows in every group, or the comparison proves little.
    assert min(want["due"].values()) > 20 and want["coming"]["15m"] > 0
    assert sum(want["coming"]["by_hour"][1:]) > 0

    lateness = state["lateness"]
    assert lateness["edges"] == EDGES and len(lateness["labels"]) == 6
    assert lateness["sitemap"] == want["bins"]["sitemap"]
    assert lateness["discovered"] == want["bins"]["discovered"]
    assert lateness["total"] == [a + b for a, b in zip(*want["bins"].values(), strict=True)]
    assert lateness["by_route"] == want["by_route"] and not lateness["by_route_truncated"]
    assert all(n > 0 for n in want["bins"]["discovered"]), "every bin exercised"

    oldest = {_ident(o): o for o in lateness["oldest"]}
    assert set(oldest) == set(want["oldest"]) and not lateness["oldest_truncated"]
    for ident, expected in want["oldest"].items():
        got = oldest[ident]
        assert got["oldest_due_minute"] == expected["oldest_due_minute"], ident
        assert got["due"] == expected["due"], ident
        assert got["lateness_ratio"] == pytest.approx(expected["lateness_ratio"], abs=1e-3)
    ratios = [o["lateness_ratio"] for o in lateness["oldest"]]
    assert ratios == sorted(ratios, reverse=True)

    classes = {_ident(c): c for c in state["classes"]["rows"]}
    assert set(classes) == set(want["classes"]) and state["classes"]["truncated"] is False
    for ident, expected in want["classes"].items():
        got = classes[ident]
        assert (got["rows"], got["due"], got["oldest_due_minute"]) == (
            expected["rows"], expected["due"], expected["oldest_due_minute"]
        ), ident  # fmt: skip


@pytest.mark.timeout(180)
def test_503_while_the_keeper_is_stopped_and_the_cluster_scope(node):
    node.start()
    now = time.time()
    node.request("POST", "/rows", [{"key": f"k{i}", "route": "news", "due_at": now - 600}
                                   for i in range(20)])
    wait_for(lambda: read_state(node.name)["now"].get("due", {}).get("total") == 20, 30,
             "20 due")
    assert len(claim(node, 2)) == 2

    def same_counts() -> tuple[dict, dict] | bool:
        a = node.request("GET", "/queue-state")[1]
        b = node.request("GET", "/queue-state?scope=cluster")[1]
        return (a, b) if a["now"]["at"] == b["now"]["at"] else False

    plain, fleet = wait_for(same_counts, 20, "two answers from one document")
    assert fleet["scope"] == "cluster" and fleet["nodes"] == [node.name]
    for group in ("now", "coming", "lateness", "classes"):
        assert fleet[group] == plain[group], group
    assert node.request("GET", "/queue-state?scope=fleet")[0] == 400

    client = Client(node.base_url)
    keeper = node.pids()["keeper"]
    os.kill(keeper, signal.SIGSTOP)
    try:
        def refused():
            status, body = node.request("GET", "/queue-state")
            return body if status == 503 else False

        body = wait_for(refused, 20, "503 once the keeper stalls")
        assert set(body) == {"trust", "now"}
        assert body["now"] == {
            "in_flight": 2, "paused": {"node": False, "routes": []}, "status": body["now"]["status"]
        }  # fmt: skip
        assert body["trust"]["vouched"] is False and "stalled" in body["trust"]["reason"]
        status, fleet = node.request("GET", "/queue-state?scope=cluster")
        assert status == 503 and fleet["nodes"] == [node.name] and "due" not in fleet["now"]
        from_client = client.queue_state()
        assert from_client["trust"]["vouched"] is False and "due" not in from_client["now"]
        local = read_state(node.name)
        assert set(local) == {"trust", "now"} and local["now"]["in_flight"] == 2
    finally:
        os.kill(keeper, signal.SIGCONT)
    wait_for(lambda: node.request("GET", "/queue-state")[0] == 200, 20, "200 after SIGCONT")
    assert client.queue_state(scope="cluster")["nodes"] == [node.name]
    client.close()
    json.dumps(read_state(node.name))  # JSON all the way down
    assert node.stop() == 0


def test_openapi_describes_the_state_routes():
    async def spec() -> dict:
        app = make_app(_ctx(lambda: None), extra_routes=state_routes)
        async with TestClient(TestServer(app)) as client:
            return await (await client.get("/openapi.json")).json()

    paths = asyncio.run(spec())["paths"]
    assert set(paths["/queue-state"]) == {"get"}
    assert set(paths["/queue-state"]["get"]["responses"]) >= {"200", "400", "503"}
    assert set(paths["/admin/pause"]) == set(paths["/admin/resume"]) == {"post"}
