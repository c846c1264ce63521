"""What a cluster queue-state request costs against the number of nodes
(issue 19, item 1; docs/fleet.md, "The fleet as one").

For each fleet size in ``--nodes`` (default 1, 3, 5): that many real nodes
(``python -m node run``, node/testing.py) over one new PostgreSQL database of
``--rows`` rows; once ``GET /queue-state?scope=cluster`` answers 200 over all
of them, ``--requests`` requests of it, one at a time, to the first node, and
as many of its own ``GET /queue-state`` for comparison. Printed per size:
p50 / p99 / mean milliseconds of each, and the CPU the asked node's HTTP
worker spent a cluster request (the fan-out's own cost there: the node
list's read, the asks, the sum). A size of 1 is a fleet of one on
PostgreSQL (the node list is still read; no peer is asked).

    .venv/bin/python bench/bench_cluster_state.py --nodes 1 3 5 --requests 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_claims import report  # noqa: E402
from node.testing import NodeProcess, finish, wait_for  # noqa: E402
from tests import pg  # noqa: E402

ENV = {"QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": "10", "QUEUE_NODE_HEARTBEAT_S": "1"}


def _seed(url: str, rows: int) -> None:
    now = time.time()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at)"
            " SELECT 'k' || i, 'r' || (i %% 20), 3600, %s - (i %% 7200)"
            " FROM generate_series(1, %s) AS i",
            (now + 1800, rows),
        )


def _timed(node: NodeProcess, path: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        status, body = node.request("GET", path)
        out.append((time.perf_counter() - t0) * 1000)
        if status != 200:
            raise SystemExit(f"{path} answered {status}: {body}")
    return out


def _stats(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {
        "p50_ms": round(ms[len(ms) // 2], 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
        "mean_ms": round(statistics.fmean(ms), 2),
    }


def one_size(size: int, rows: int, requests: int) -> dict:
    url = pg.create_database()
    base = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    names = sorted(f"q-{uuid.uuid4().hex[:8]}" for _ in range(size))
    nodes = [NodeProcess(base / n, n, "--store", url, env=ENV) for n in names]
    try:
        from node.store.postgres import PostgresStore

        PostgresStore(url).close()
        _seed(url, rows)
        for node in nodes:
            node.start(timeout_s=120)

        def summed() -> bool:
            status, doc = nodes[0].request("GET", "/queue-state?scope=cluster")
            return status == 200 and doc["nodes"] == names

        wait_for(summed, 180, f"the cluster of {size} summed")
        worker = psutil.Process(nodes[0].pids_by_role()["worker-0"])
        _timed(nodes[0], "/queue-state?scope=cluster", 20)  # warm: the node list's connection
        cpu0 = sum(worker.cpu_times()[:2])
        cluster = _timed(nodes[0], "/queue-state?scope=cluster", requests)
        cpu_ms = (sum(worker.cpu_times()[:2]) - cpu0) * 1000 / requests
        local = _timed(nodes[0], "/queue-state", requests)
        return {
            "bench": "cluster_state", "nodes": size, "rows": rows, "requests": requests,
            "cluster": _stats(cluster), "local": _stats(local),
            "worker_cpu_ms_per_cluster_request": round(cpu_ms, 2),
        }  # fmt: skip
    finally:
        finish(nodes, names[0])
        for name in names[1:]:
            finish([], name)
        pg.drop_database(url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--rows", type=int, default=30_000)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    print("nodes  cluster p50/p99/mean ms   local p50/p99/mean ms   worker CPU ms/request")
    for size in args.nodes:
        doc = one_size(size, args.rows, args.requests)
        report(doc, "cluster_state.jsonl")
        c, lo = doc["cluster"], doc["local"]
        print(
            f"{size:5d}  {c['p50_ms']:6.2f} {c['p99_ms']:7.2f} {c['mean_ms']:6.2f}"
            f"      {lo['p50_ms']:6.2f} {lo['p99_ms']:7.2f} {lo['mean_ms']:6.2f}"
            f"      {doc['worker_cpu_ms_per_cluster_request']:.2f}"
        )


if __name__ == "__main__":
    main()
