"""Commit-to-keeper lag and keeper work per change on a PostgreSQL fleet of
three nodes under outside writes (issue 18, item 6), the keeper woken by
LISTEN/NOTIFY against the keeper polling every 20 ms, alternated in one run.

Each round, for each mode: a fresh database state (the schedule emptied and
``--rows`` rows loaded), three real nodes (``python -m node run --store
postgresql://…``, one HTTP worker each) started with
``QUEUE_NODE_KEEPER_LISTEN`` 1 or 0, and once all three see each other:

- idle: the keepers' CPU over ``--idle-s`` seconds with nothing written
  (what waking costs when there is nothing to do);
- load: ``--writers`` processes upsert random keys of the table from outside
  the node (plain SQL, as a producer writing the database would), in
  statements of ``--batch`` rows, paced to ``--rate`` rows a second in all,
  for ``--seconds``. The rate reached is what the writers committed;
- lag: each keeper's own commit-to-applied figures of the outside changes
  (``trust.lag.outside`` of its ``GET /queue-state``: the change's log time,
  ``clock_timestamp()`` in its trigger, to the keeper's apply, so the rest of
  its statement and the commit count as lag) over the load, read once every
  keeper has applied the whole log; p50 / p99 / max of each keeper, and the
  worst of the three;
- work: the keepers' CPU (user + system, psutil) over the load, divided by
  the changes they applied (each keeper reads every change; it applies and
  buckets the third its node owns).

The database flushes commits (as a node's would). One JSON line a mode and
round (``--json PATH``: the lines as one list).

    .venv/bin/python bench/bench_fleet_lag.py --rate 15000 --seconds 30 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import psutil  # noqa: E402
import psycopg  # noqa: E402

from bench.common import add_json_option, keep, write_json  # noqa: E402
from node.store.postgres import PostgresStore  # noqa: E402
from node.testing import NodeProcess, cleanup_segments, wait_for  # noqa: E402
from tests import pg  # noqa: E402

NODES = 3
# The keepers' environment in each mode: woken by NOTIFY (the thread's wakes
# at least 10 ms apart, the default; or each passed on at once), or polling
# every 20 ms.
MODES = {
    "listen": {"QUEUE_NODE_KEEPER_LISTEN": "1"},
    "listen-nogap": {"QUEUE_NODE_KEEPER_LISTEN": "1", "QUEUE_NODE_KEEPER_LISTEN_GAP_S": "0"},
    "poll": {"QUEUE_NODE_KEEPER_LISTEN": "0"},
}
UPSERT = (
    "INSERT INTO schedule (key, route, cadence_s, due_at)"
    " SELECT k, 'pages', 3600, d FROM unnest(%s::text[], %s::float8[]) AS t(k, d)"
    " ON CONFLICT (key) DO UPDATE SET due_at = EXCLUDED.due_at"
)
# Due times a day and more ahead: nothing comes due, nothing is claimed; the
# keepers only follow the log.
AHEAD_S = 86_400.0


def _key(i: int) -> str:
    return f"item-{i:08d}"


def _load(url: str, rows: int) -> None:
    pg.reset(url)
    now = time.time()
    with psycopg.connect(url, autocommit=True) as conn:
        for i in range(0, rows, 5_000):
            keys = [_key(j) for j in range(i, min(rows, i + 5_000))]
            conn.execute(UPSERT, (keys, [now + AHEAD_S + j % 3600 for j in range(len(keys))]))
        conn.execute("DELETE FROM changes")  # the keepers start from the table, not its log


def _writer(url: str, rows: int, rate: float, seconds: float, batch: int, start_at: float,
            seed: int, writers: int, out: Any) -> None:  # fmt: skip
    """One writer process: ``rate`` rows a second in statements of ``batch``
    random keys, from ``start_at`` for ``seconds``; puts the rows committed."""
    rnd = random.Random(seed)
    written = 0
    with psycopg.connect(url, autocommit=True) as conn:
        time.sleep(max(0.0, start_at - time.time()))  # all writers start together
        t0 = time.monotonic()
        while True:
            elapsed = time.monotonic() - t0
            if elapsed >= seconds:
                break
            ahead = written / rate - elapsed  # paced: never ahead of the schedule
            if ahead > 0:
                time.sleep(ahead)
            # Each writer its own keys (``seed`` of ``writers``): writers that
            # lock the same rows in different orders deadlock.
            keys = sorted({_key(rnd.randrange(seed, rows, writers)) for _ in range(batch)})
            due = time.time() + AHEAD_S + rnd.uniform(0, 3600)
            conn.execute(UPSERT, (keys, [due] * len(keys)))
            written += len(keys)
    out.put(written)


def _state(node: NodeProcess) -> dict | None:
    try:
        status, doc = node.request("GET", "/queue-state", timeout_s=5)
    except OSError:
        return None
    return doc if status == 200 and isinstance(doc, dict) else None


def _all_live(nodes: list[NodeProcess]) -> bool:
    for node in nodes:
        doc = _state(node)
        if doc is None or len((doc["trust"].get("membership") or {}).get("live", [])) != NODES:
            return False
    return True


def _keeper_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def _top_seq(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT coalesce(max(seq), 0) FROM changes").fetchone()[0]


def _caught_up(nodes: list[NodeProcess], top: int) -> list[dict] | None:
    docs = [_state(n) for n in nodes]
    if any(d is None or d["trust"]["feed_seq"] < top for d in docs):
        return None
    return docs  # type: ignore[return-value]


def _one(url: str, mode: str, args: argparse.Namespace, tmp: Path, tag: str) -> dict:
    _load(url, args.rows)
    env = {
        **MODES[mode],
        "QUEUE_NODE_STATE_INTERVAL_S": "0.5",
        "QUEUE_NODE_HEARTBEAT_S": "1",
    }
    names = [f"lag{tag}{c}" for c in "abc"[:NODES]]
    nodes = [
        NodeProcess(tmp / f"{name}-{mode}", name, "--store", url, env=env, test_hooks=False)
        for name in names
    ]
    try:
        for node in nodes:
            node.start(timeout_s=60)
        wait_for(lambda: _all_live(nodes), 60, "three live nodes")
        keepers = [int(n.pids()["keeper"]) for n in nodes]
        cpu0 = _keeper_cpu(keepers)
        time.sleep(args.idle_s)  # measuring idle CPU over a fixed span
        idle_cpu_ms_s = (_keeper_cpu(keepers) - cpu0) * 1000 / args.idle_s / NODES
        applied0 = [d["trust"]["apply"]["changes"] for d in map(_state, nodes)]  # type: ignore[index]
        cpu0 = _keeper_cpu(keepers)
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        start_at = time.time() + 1.0
        writers = [
            ctx.Process(target=_writer, args=(url, args.rows, args.rate / args.writers,
                                              args.seconds, args.batch, start_at, i,
                                              args.writers, out))
            for i in range(args.writers)
        ]  # fmt: skip
        for w in writers:
            w.start()
        written = sum(out.get(timeout=args.seconds + 60) for _ in writers)
        for w in writers:
            w.join()
        top = _top_seq(url)
        docs = wait_for(lambda: _caught_up(nodes, top), 120, "every keeper through the log")
        cpu = _keeper_cpu(keepers) - cpu0
        time.sleep(1.0)  # the next state write carries the lag of the last changes
        docs = [_state(n) for n in nodes]
        applied = sum(d["trust"]["apply"]["changes"] for d in docs) - sum(applied0)  # type: ignore[index]
        lags = [d["trust"]["lag"].get("outside") or {} for d in docs]  # type: ignore[index]
        doc = {
            "mode": mode,
            "nodes": NODES,
            "target_rows_s": args.rate,
            "reached_rows_s": round(written / args.seconds),
            "statements_s": round(written / args.batch / args.seconds),
            "changes_per_keeper": applied // NODES,
            "lag_p50_ms": [x.get("p50_ms") for x in lags],
            "lag_p99_ms": [x.get("p99_ms") for x in lags],
            "lag_max_ms": [x.get("max_ms") for x in lags],
            "worst_p99_ms": max(x.get("p99_ms", 0) for x in lags),
            "keeper_cpu_us_per_change": round(cpu * 1e6 / applied, 2) if applied else None,
            "keeper_cpu_us_per_change_above_idle": round(
                (cpu - idle_cpu_ms_s / 1000 * NODES * args.seconds) * 1e6 / applied, 2
            )
            if applied
            else None,  # fmt: skip
            "keeper_idle_cpu_ms_per_s": round(idle_cpu_ms_s, 2),
            "load_avg_1m": round(psutil.getloadavg()[0], 2),
        }
        print(json.dumps(keep(doc)), flush=True)
        return doc
    finally:
        for node in nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.stop(timeout_s=30)
        for name in names:
            cleanup_segments(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=15_000, help="rows/s in all (15000)")
    parser.add_argument("--writers", type=int, default=4, help="writer processes (4)")
    parser.add_argument("--batch", type=int, default=50, help="rows a statement (50)")
    parser.add_argument("--seconds", type=float, default=30, help="load per mode (30)")
    parser.add_argument("--rows", type=int, default=50_000, help="rows in the table (50000)")
    parser.add_argument("--idle-s", type=float, default=5, help="idle CPU span (5)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of both modes (1)")
    parser.add_argument("--modes", default="listen,poll", help="of listen, listen-nogap, poll")
    add_json_option(parser)
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes) or args.rate <= 0:
        print(f"bench_fleet_lag: --modes takes {', '.join(MODES)}; --rate > 0", file=sys.stderr)
        return 2
    url = pg.create_database(flush_commits=True)
    tmp = Path(tempfile.mkdtemp(prefix="qn-fleet-lag-"))
    results: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        PostgresStore(url).close()  # the schema
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                tag = f"{r}{modes.index(mode)}"
                results[mode].append(_one(url, mode, args, tmp, tag))
    finally:
        pg.drop_database(url)
        shutil.rmtree(tmp, ignore_errors=True)
    for mode, docs in results.items():
        print(
            f"{mode:12s} {statistics.median(d['reached_rows_s'] for d in docs):>7.0f} rows/s"
            f"  lag p50 {statistics.median(max(d['lag_p50_ms']) for d in docs):7.2f} ms"
            f"  worst p99 {statistics.median(d['worst_p99_ms'] for d in docs):7.2f} ms"
            f"  keeper {statistics.median(d['keeper_cpu_us_per_change'] for d in docs):6.2f}"
            " µs/change"
            f"  idle {statistics.median(d['keeper_idle_cpu_ms_per_s'] for d in docs):6.2f} ms/s",
            flush=True,
        )
    write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
