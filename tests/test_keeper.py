"""The keeper, one tick at a time: real store (memory and SQLite), real
segments, time passed in."""

from __future__ import annotations

import dataclasses
import random
import sqlite3
import time
from collections import Counter

import pytest

from keeper.process import LOAD_CHUNK, Keeper
from node.config import Config, RouteConfig
from node.rows import RowWrite
from node.store import open_store
from shm.ready import ReadySet
from shm.state import StateBuffer

NOW = 1_800_000_000.0  # a fixed wall clock, minute-aligned


def _config(name: str, tmp_path, **kw) -> Config:
    routes = {
        "pages": RouteConfig(cadence_s=3600, sitemap_boost=0.5),
        "listings": RouteConfig(cadence_s=86400, sitemap_boost=1.0),
    }
    base = dict(name=name, data_dir=tmp_path, workers=1, ready_size=500, routes=routes)
    base.update(kw)
    return Config(**base)


@pytest.fixture(params=["memory", "sqlite"])
def store(request, tmp_path):
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path}/schedule.db"
    s = open_store(url)
    yield s
    s.close()


@pytest.fixture
def segments(node_name):
    ready = ReadySet.create(node_name, 500)
    state = StateBuffer.create(node_name, started_at=NOW - 1)
    yield ready, state
    for seg in (ready, state):
        seg.close()
    ReadySet.unlink(node_name)
    StateBuffer.unlink(node_name)


def _rows(n: int, seed: int = 1) -> list[RowWrite]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        route = rnd.choice(["pages", "listings", "unconfigured"])
        cadence = rnd.choice([None, None, 900, 7200])
        out.append(
            RowWrite(
                key=f"https://example.com/items/{i:010d}/slug-{rnd.randrange(1000):03d}",
                route=route,
                cadence_s=cadence,
                sitemap=rnd.random() < 0.3,
                due_at=NOW + rnd.uniform(-3 * 86400, 2 * 86400),
            )
        )
    return out


def _table(store) -> dict[str, tuple[int, int]]:
    """key -> (due minute, version), walked from the store."""
    out = {}
    after = None
    while True:
        rows = store.walk(after, 5000)
        for row in rows:
            out[row.key] = (int(row.due_at // 60), row.version)
        if len(rows) < 5000:
            return out
        after = rows[-1].key


def _keeper_view(keeper: Keeper) -> dict[str, tuple[int, int]]:
    return {key: (minute, version) for key, minute, _cid, version in keeper.buckets.items()}


def _run_until_live(keeper: Keeper, now: float, limit: int = 1000) -> None:
    for _ in range(limit):
        keeper.tick(now)
        if keeper.status == "live" and keeper.exact:
            return
    raise AssertionError(f"keeper not live after {limit} ticks: {keeper.status} {keeper.exact}")


def test_load_equals_table_and_counts_match(store, segments, node_name, tmp_path):
    store.upsert(_rows(3000), now=NOW)
    keeper = Keeper(_config(node_name, tmp_path), store, *segments)
    keeper.start(NOW)
    _run_until_live(keeper, NOW)
    assert _keeper_view(keeper) == _table(store)
    keeper.write_state(NOW)
    doc = segments[1].read()["doc"]
    due = Counter()
    for row in store.walk(None, 10_000):
        if int(row.due_at // 60) <= int(NOW // 60):
            due["sitemap" if row.sitemap else "discovered"] += 1
    assert doc["now"]["due"] == {
        "sitemap": due["sitemap"],
        "discovered": due["discovered"],
        "total": due["sitemap"] + due["discovered"],
    }


def test_first_publish_before_walk_ends_and_walk_never_overwrites_newer(
    store, segments, node_name, tmp_path
):
    n = LOAD_CHUNK * 2 + 100
    rows = _rows(n, seed=2)
    store.upsert(rows, now=NOW)
    keeper = Keeper(_config(node_name, tmp_path), store, *segments)
    keeper.start(NOW)
    keeper.tick(NOW)
    ready, state = segments
    assert keeper.status == "loading"
    assert ready.snapshot().generation >= 1, "no publish after the first chunk"
    assert state.read()["status"] == "loading"
    # Writes during the walk, to keys the walk has not reached yet and to
    # keys it has: updates, deletes, deletes then re-inserts, inserts.
    rnd = random.Random(3)
    late_keys = [r.key for r in rnd.sample(rows, 400)]
    store.upsert(
        [RowWrite(key=k, route="pages", due_at=NOW - 7 * 86400) for k in late_keys[:100]], now=NOW
    )
    store.delete(late_keys[100:200])
    store.delete(late_keys[200:300])
    store.upsert([RowWrite(key=k, route="listings", due_at=NOW) for k in late_keys[200:300]],
                 now=NOW)
    store.upsert([RowWrite(key=f"new-{i}", route="pages") for i in range(100)], now=NOW)
    _run_until_live(keeper, NOW)
    assert _keeper_view(keeper) == _table(store)


def test_mixed_writes_while_running(store, segments, node_name, tmp_path):
    store.upsert(_rows(2000, seed=4), now=NOW)
    keeper = Keeper(_config(node_name, tmp_path), store, *segments)
    keeper.start(NOW)
    _run_until_live(keeper, NOW)
    rnd = random.Random(5)
    keys = [f"k{i}" for i in range(3000)]
    writes = 0
    while writes < 20_000:
        batch = []
        for _ in range(200):
            key = rnd.choice(keys)
            batch.append(RowWrite(key=key, route=rnd.choice(["pages", "listings"]),
                                  due_at=NOW + rnd.uniform(-86400, 86400),
                                  sitemap=rnd.random() < 0.5))
        store.upsert(batch, now=NOW)
        store.delete(rnd.sample(keys, 20))
        writes += 220
        if rnd.random() < 0.5:
            keeper.tick(NOW)
    _run_until_live(keeper, NOW)
    keeper.drain_feed(NOW)
    assert _keeper_view(keeper) == _table(store)


def test_outside_program_write_is_seen(segments, node_name, tmp_path):
    path = tmp_path / "schedule.db"
    store = open_store(f"sqlite:///{path}")
    store.upsert(_rows(100), now=NOW)
    keeper = Keeper(_config(node_name, tmp_path), store, *segments)
    keeper.start(NOW)
    _run_until_live(keeper, NOW)
    other = sqlite3.connect(path)
    with other:
        other.execute(
            "INSERT INTO schedule (key, route, due_at) VALUES ('outside', 'pages', ?)", (NOW,)
        )
        other.execute("UPDATE schedule SET due_at = ? WHERE key = ?",
                      (NOW + 3600, _rows(100)[0].key))
    other.close()
    keeper.tick(NOW)
    assert "outside" in keeper.buckets
    assert _keeper_view(keeper) == _table(store)
    store.close()


def test_ready_set_is_rank_order_and_leaves_out_paused(store, segments, node_name, tmp_path):
    store.upsert(_rows(2000, seed=6), now=NOW)
    config = _config(node_name, tmp_path)
    keeper = Keeper(config, store, *segments)
    keeper.start(NOW)
    _run_until_live(keeper, NOW)
    keeper.paused_routes = frozenset({"listings"})
    keeper.publish(NOW)
    snap = segments[0].snapshot()
    ranks = [e.rank for e in snap.entries]
    assert ranks == sorted(ranks, reverse=True)
    routes = {keeper.classes.info(e.class_id).route for e in snap.entries}
    assert "listings" not in routes
    # Brute force: the same number of entries as due, unpaused rows (capped at K).
    due = [
        r for r in store.walk(None, 10_000)
        if r.route != "listings" and int(r.due_at // 60) <= int(NOW // 60)
    ]
    assert len(snap.entries) == min(len(due), config.ready_size)


def test_verification_repairs_a_corrupted_view(store, segments, node_name, tmp_path):
    store.upsert(_rows(500, seed=7), now=NOW)
    keeper = Keeper(_config(node_name, tmp_path), store, *segments, test_hooks=True)
    keeper.start(NOW)
    _run_until_live(keeper, NOW)
    keys = [k for k, *_ in keeper.buckets.items()][:3]
    for key, mode in zip(keys, ["move", "drop", "move"], strict=True):
        assert keeper.answer({"op": "corrupt", "key": key, "mode": mode}, NOW)["ok"]
    assert keeper.answer({"op": "corrupt", "key": "phantom-key", "mode": "phantom"}, NOW)["ok"]
    assert _keeper_view(keeper) != _table(store)
    keeper.start_verify(NOW)
    for _ in range(100):
        keeper.tick(NOW)
        if keeper.stats.verify["runs"]:
            break
    assert keeper.stats.verify["runs"] == 1
    assert keeper.stats.verify["repairs"] == 4
    assert _keeper_view(keeper) == _table(store)


def test_repair_never_overwrites_a_newer_event(store, segments, node_name, tmp_path):
    store.upsert([RowWrite(key="a", route="pages", due_at=NOW)], now=NOW)
    keeper = Keeper(_config(node_name, tmp_path), store, *segments)
    keeper.start(NOW)
    _run_until_live(keeper, NOW)
    stale = store.get("a")
    snap_seq = store.last_seq()
    # A newer event arrives between the verification read and the compare.
    store.upsert([RowWrite(key="a", route="pages", due_at=NOW + 86400)], now=NOW)
    keeper.drain_feed(NOW)
    assert keeper._reconcile("a", stale, snap_seq) is False
    assert keeper.buckets.get("a")[0] == int((NOW + 86400) // 60)
    # And a stale "row is gone" does not remove a row re-inserted since.
    store.delete(["a"])
    gone_seq = store.last_seq()
    store.upsert([RowWrite(key="a", route="pages", due_at=NOW)], now=NOW)
    keeper.drain_feed(NOW)
    assert keeper._reconcile("a", None, gone_seq) is False
    assert "a" in keeper.buckets


def test_route_default_change_reclassifies_in_memory(store, segments, node_name, tmp_path):
    store.upsert([RowWrite(key=f"p{i}", route="pages", due_at=NOW - 1800) for i in range(50)],
                 now=NOW)
    config = _config(node_name, tmp_path)
    keeper = Keeper(config, store, *segments)
    keeper.start(NOW)
    _run_until_live(keeper, NOW)
    before = keeper.explain("p1", NOW)
    assert before["class"]["cadence_s"] == 3600
    new = dataclasses.replace(
        config, routes={**config.routes, "pages": RouteConfig(cadence_s=600, sitemap_boost=0.5)}
    )
    reads_before = store.last_seq()
    keeper.buckets.reconfigure(new)
    after = keeper.explain("p1", NOW)
    assert after["class"]["cadence_s"] == 600
    assert after["rank"] == pytest.approx(before["rank"] * 6)
    assert store.last_seq() == reads_before


def test_explain_answers_through_the_ask_channel(store, segments, node_name, tmp_path):
    from keeper.ask import AskServer, ask, unlink_all

    store.upsert([RowWrite(key="x", route="pages", due_at=NOW - 60)], now=NOW)
    keeper = Keeper(_config(node_name, tmp_path), store, *segments)
    keeper.start(NOW)
    _run_until_live(keeper, NOW)
    keeper.publish(NOW)
    server = AskServer(node_name)
    try:
        import threading

        answered = threading.Event()

        def serve():
            deadline = time.monotonic() + 10
            while not answered.is_set() and time.monotonic() < deadline:
                for req in server.poll():
                    server.answer(req, keeper.answer(req, NOW))
                    answered.set()
                answered.wait(0.005)

        t = threading.Thread(target=serve)
        t.start()
        reply = ask(node_name, {"op": "explain", "key": "x"}, timeout_s=5)
        t.join()
        assert reply["held"] is True
        assert reply["in_ready_set"] is True
        assert reply["class"]["route"] == "pages"
    finally:
        server.close()
        unlink_all(node_name)
