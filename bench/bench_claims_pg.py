"""LocalClaimer on a PostgreSQL node against FOR UPDATE SKIP LOCKED, one run.

    .venv/bin/python bench/bench_claims_pg.py --rows 100000 --batch 1 64 --procs 2 --seconds 5

Issue 18, item 1's target: LocalClaimer grants/s at batch 64 on a node whose
store is PostgreSQL at least twice PostgreSQL's own FOR UPDATE SKIP LOCKED
claim, on the same server in the same run. On such a node the claim path
reads each batch's rows through the node's row service (``workers/rows``:
one request over a UNIX socket, one ``SELECT … WHERE key = ANY($1)`` there),
so this measures that path whole: the take from the ready set, the read, the
grants.

The workload is ``bench/bench_claims.py``'s (``rows`` rows, keys of about 55
characters, a small JSON payload, due times spread over the past 30 days so
every row is due, 60 s leases, ``procs`` claimer processes looping
claim(batch) and timing every call), with its claimer loop and its stop rule.
The node runs for real (``python -m node run --store postgresql://…``) on a
database of its own on the server ``QN_BENCH_PG_DSN`` names (default
``postgresql://postgres@127.0.0.1:5432/postgres``), seeded once through the
store and started again for every batch, so that each measurement starts
from ``rows`` unleased rows (the leases live in the node's shared memory).
The peer is ``bench/claims_external.py``'s ``postgres_skip_locked`` (its best
index layout of three) on a database of its own on the same server.

Results: one JSON line each, appended to ``bench/results/claims_pg.jsonl``,
then the ratio per batch and round. With ``--rounds N`` everything runs N
times, the node and its peer one after the other in each round, and the
ratio reported is the median round's: on a shared machine the peer's rate
alone moved by 2x between runs minutes apart.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_claims import LEASE_CAPACITY, Node, measure, report  # noqa: E402 - path fix first
from bench.claims_external import (  # noqa: E402
    PG_DSN,
    _pg_create_db,
    _pg_drop_db,
    _pg_server,
    due_of,
    key_of,
    run_postgres_skip_locked,
)
from bench.common import add_json_option, write_json  # noqa: E402

# The target: the node's LocalClaimer over SKIP LOCKED, at batch 64.
TARGET = {64: 2.0}
SEED_CHUNK = 10_000


def seed(dsn: str, rows: int) -> float:
    """``rows`` due rows in the node's schema (the store makes it); seconds taken."""
    from node.core.rows import RowWrite
    from node.store.postgres import PostgresStore

    t0 = time.perf_counter()
    now = time.time()
    store = PostgresStore(dsn)
    try:
        for lo in range(0, rows, SEED_CHUNK):
            store.upsert(
                [
                    RowWrite(
                        key=key_of(i),
                        route=f"route{i % 20:02d}",
                        due_at=due_of(i, rows, now),
                        payload={"route": f"route{i % 20:02d}", "n": i},
                        job=f"job-{i % 7}",
                    )
                    for i in range(lo, min(rows, lo + SEED_CHUNK))
                ],
                now=now,
            )
    finally:
        store.close()
    return time.perf_counter() - t0


class PgNode(Node):
    """``python -m node run`` on the PostgreSQL database ``dsn``."""

    def __init__(self, dsn: str, workers: int, ready_size: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="qn-bench-pg-"))
        self.name = f"bench-{uuid.uuid4().hex[:8]}"
        env = dict(os.environ, QUEUE_NODE_LEASE_CAPACITY=str(LEASE_CAPACITY))
        argv = [
            sys.executable, "-m", "node", "run",
            "--store", dsn,
            "--data-dir", str(self.dir),
            "--name", self.name,
            "--http", "127.0.0.1:0",
            "--workers", str(workers),
            "--ready-size", str(ready_size),
        ]  # fmt: skip
        self.log = open(self.dir / "node.log", "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=self.log)
        self.http = self._wait_started()


def run_node(dsn: str, rows: int, batch: int, args: Any) -> dict:
    node = PgNode(dsn, workers=args.workers, ready_size=args.ready_size)
    try:
        cfg = {"name": node.name, "dir": str(node.dir), "http": node.http}
        db = dsn.rsplit("/", 1)[1]
        res = measure("node_local", cfg, batch, args.procs, args.seconds, node_pid=node.proc.pid,
                      pg=(dsn, db))  # fmt: skip
    finally:
        node.stop()
    res.update(variant="node_local_pg", rows=rows, ready_size=args.ready_size)
    return time_to_last_grant(res, rows)


def time_to_last_grant(res: dict, rows: int) -> dict:
    """A run that leased every row ran out before its window ended: timed,
    like the peer (which stops at its first empty claim), to its last grant,
    not to the window's end, and marked ``ran_out`` (more ``--rows`` or fewer
    ``--seconds`` measure it over a whole window)."""
    last = res.get("last_grant_s") or 0.0
    if res["grants"] >= rows and not res["drained"] and 0 < last < res["seconds"]:
        res.update(ran_out=True, seconds=last, grants_per_s=round(res["grants"] / last, 1))
        print(f"node_local_pg: every one of the {rows} rows leased {last:.2f} s into the "
              "window: timed to the last grant", file=sys.stderr)  # fmt: skip
    return res


def ratios(results: list[dict]) -> None:
    """Per batch and round, the node's grants/s over the peer's (measured one
    after the other); with several rounds, the median round's ratio and the
    range, since a burst of another job moves one 5 s window by a third."""
    print("\nbatch round  node_local_pg grants/s  p50 ms   SKIP LOCKED grants/s  p50 ms   ratio")
    for batch in sorted({r["batch"] for r in results}):
        found = []
        for r in sorted({r["round"] for r in results}):
            pair = [x for x in results if x["batch"] == batch and x["round"] == r]
            node = [x for x in pair if x["variant"] == "node_local_pg"]
            peer = [x for x in pair if x["variant"] != "node_local_pg"]
            if not node or not peer or not peer[0]["grants_per_s"]:
                continue
            n, p = node[0], peer[0]
            ratio = n["grants_per_s"] / p["grants_per_s"]
            found.append(ratio)
            print(
                f"{batch:>5} {r:>5}  {n['grants_per_s']:>22.0f} {n['p50_ms']!s:>7}   "
                f"{p['grants_per_s']:>20.0f} {p['p50_ms']!s:>7}   {ratio:6.2f}"
            )
            _cpu_a_grant(n)
        if not found:
            continue
        found.sort()
        median = found[(len(found) - 1) // 2]  # the lower middle of an even count
        want = TARGET.get(batch)
        mark = "" if want is None else f"  (target {want}: {'ok' if median >= want else 'MISS'})"
        print(f"{batch:>5}  median ratio {median:.2f} of {len(found)} "
              f"(range {found[0]:.2f}-{found[-1]:.2f}){mark}")  # fmt: skip


def _cpu_a_grant(res: dict) -> None:
    """The CPU a grant cost in each process of a node run (µs), the
    PostgreSQL backends of the node's database among them."""
    grants = res.get("grants") or 0
    spent = {name: s for name, s in res.get("cpu_s", {}).items() if s}
    if not grants or not spent:
        return
    parts = "  ".join(f"{name} {s / grants * 1e6:.1f}" for name, s in spent.items())
    print(f"{'':>12}CPU a grant, µs: {parts}  | all {sum(spent.values()) / grants * 1e6:.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/bench_claims_pg.py", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--workers", type=int, default=1, help="the node's HTTP workers")
    p.add_argument("--ready-size", type=int, default=5000)
    p.add_argument(
        "--rounds", type=int, default=1, help="run it all N times; the ratio is the median round's"
    )
    add_json_option(p)
    args = p.parse_args(argv)
    db = _pg_create_db()
    results = []
    try:
        # A URL (the node's --store takes no key=value conninfo).
        dsn = f"{PG_DSN.rsplit('/', 1)[0]}/{db}"
        seed_s = seed(dsn, args.rows)
        server = _pg_server(dsn)
        print(f"seeded {args.rows} rows in {seed_s:.1f} s; PostgreSQL {server['server']}",
              file=sys.stderr)  # fmt: skip
        for round_ in range(args.rounds):
            for batch in args.batch:
                res = run_node(dsn, args.rows, batch, args)
                res.update(
                    postgres=server["server"], synchronous_commit=server["synchronous_commit"]
                )
                peer = run_postgres_skip_locked(args.rows, batch, args.procs, args.seconds)
                for doc in (res, peer):
                    doc["round"] = round_
                    report(doc, "claims_pg.jsonl")
                    results.append(doc)
    finally:
        _pg_drop_db(db)
    ratios(results)
    write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
