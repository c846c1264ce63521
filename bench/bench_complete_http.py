"""HTTP completions/s: one ``POST /complete`` per result against one
``POST /complete`` with ``{"items": [...]}`` per claimed batch, on one node.

A node (``python -m node run``, ``node.testing.NodeProcess``) with ``--rows``
due rows (keys of about 55 characters); ``--procs`` processes each loop
``Client.claim(batch)`` then complete every lease with a 200-byte result,
either one request per result (``single``) or the whole claim in one request
(``items``), for ``--seconds``. Prints one JSON line per mode: completions/s,
requests and the cycle's p50/p99 (a claim and its completions). The modes run
one after the other on the same node; each completes rows the other no longer
finds due, so give it rows for both (a completed row is due again only after
its cadence).

    .venv/bin/python bench/bench_complete_http.py --rows 200000 --procs 2 --seconds 15
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_json_option, keep, write_json  # noqa: E402

RESULT = {"text": "x" * 180}  # about 200 bytes of JSON


def _loop(base_url: str, mode: str, batch: int, seconds: float, start_at: float, out) -> None:
    from node.client import Client

    client = Client(base_url)
    done = requests = 0
    cycles: list[float] = []
    while time.time() < start_at:
        time.sleep(0.001)
    deadline = start_at + seconds
    while time.time() < deadline:
        began = time.perf_counter()
        grants = client.claim(batch, lease_s=300, consumer=f"bench-{mode}")
        requests += 1
        if not grants:
            time.sleep(0.01)
            continue
        if mode == "items":
            answers = client.complete_many([(g.lease_id, g.key, RESULT) for g in grants])
            done += sum(1 for a in answers if isinstance(a, int))
            requests += 1
        else:
            for g in grants:
                client.complete(g.lease_id, g.key, RESULT)
                done += 1
                requests += 1
        cycles.append(time.perf_counter() - began)
    out.put({"done": done, "requests": requests, "cycles": cycles})
    client.close()


def _seed(base_url: str, rows: int) -> None:
    from node.client import Client

    client = Client(base_url, timeout_s=120)
    due = time.time() - 30 * 86400
    step = 10_000
    for at in range(0, rows, step):
        client.upsert([
            {"key": f"https://example.com/catalogue/items/{i:012d}/detail?v=1", "route": "r",
             "due_at": due + i * 1e-3, "payload": {"i": i}, "job": "bench"}
            for i in range(at, min(rows, at + step))
        ])  # fmt: skip
    client.close()


def run(mode: str, base_url: str, procs: int, batch: int, seconds: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 2.0  # every process started and connected
    workers = [
        ctx.Process(target=_loop, args=(base_url, mode, batch, seconds, start_at, out))
        for _ in range(procs)
    ]
    for w in workers:
        w.start()
    got = [out.get(timeout=seconds + 120) for _ in workers]
    for w in workers:
        w.join(30)
    cycles = sorted(c for g in got for c in g["cycles"])
    done = sum(g["done"] for g in got)
    return {
        "bench": "complete_http",
        "mode": mode,
        "procs": procs,
        "batch": batch,
        "seconds": seconds,
        "completed": done,
        "completed_per_s": round(done / seconds),
        "requests_per_s": round(sum(g["requests"] for g in got) / seconds),
        "cycle_p50_ms": round(statistics.median(cycles) * 1000, 2) if cycles else None,
        "cycle_p99_ms": round(cycles[int(len(cycles) * 0.99)] * 1000, 2) if cycles else None,
    }


def main() -> None:
    from node.testing import NodeProcess, finish, wait_for

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--modes", nargs="+", default=["single", "items"])
    parser.add_argument("--workers", type=int, default=1, help="the node's HTTP workers")
    add_json_option(parser)
    args = parser.parse_args()
    name = f"bench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        node = NodeProcess(Path(tmp) / "data", name, workers=args.workers, test_hooks=False)
        try:
            node.start()
            _seed(node.base_url, args.rows)
            wait_for(lambda: node.request("POST", "/claim", {"max": 1, "consumer": "probe"})[1]
                     .get("leases"), 60, "the first publish")  # fmt: skip
            for mode in args.modes:
                res = run(mode, node.base_url, args.procs, args.batch, args.seconds)
                print(json.dumps(keep({**res, "rows": args.rows, "workers": args.workers})),
                      flush=True)  # fmt: skip
            node.stop()
            write_json(args.json)
        finally:
            finish([node], name)


if __name__ == "__main__":
    main()
