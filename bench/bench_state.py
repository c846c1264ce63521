"""What the queue state costs (issue 4): the keeper's document, and
``GET /queue-state`` while claimers run.

    .venv/bin/python bench/bench_state.py doc  --rows 250000 1000000 --calls 500
    .venv/bin/python bench/bench_state.py http --rows 250000 --procs 2 --batch 16 --seconds 10
    .venv/bin/python bench/bench_state.py http --claim-only --lease-capacity 524288

- doc: ``Keeper.counts_doc(now)`` (keeper/report.py), the document the
  keeper writes into the state buffer every ``state_interval_s``. A real
  Keeper over a memory store, its buckets loaded the way the keeper loads
  them (``reserve``, then ``load_rows`` 20,000 rows at a time, keys from
  ``bench.common.key_of``), 3 routes x 3 cadences (the route's and two row
  cadences) x the sitemap flag = 18 classes, due times spread evenly from
  ``--late-days`` late to ``--ahead-days`` ahead (``--classes N``: more
  routes, 6 classes each, for about N). The keeper's other state is
  filled as a busy keeper's is: 10,000 lag samples per origin (the ring is
  full after 10,000 writes) and 60 minutes of flow. Each call is one state
  write's worth: ``now`` moves on by ``--step-s`` (5 s, the default state
  interval) between calls, so the due counts advance a minute every 12th
  call, as in a running keeper. The first call (which merges the load's
  pending values) is reported apart. Target: at most 1 ms at both sizes (the
  cost follows classes, not rows). The parts are timed apart too (counts,
  coming, lateness, oldest_due, the lag percentiles, the flow, and msgpack
  packing, which ``write_doc`` adds), the whole call again with empty lag
  rings (a keeper that applied no change lately), and a cProfile of ``--profile-calls``
  calls is printed when the p99 misses the target.
- http: a real node (``python -m node run``, the SQLite file seeded once as
  bench/bench_claims.py seeds it and copied fresh), ``--procs`` claimer
  processes claiming through ``node.client.LocalClaimer`` at full speed and
  handing in a result for every lease in one ledger call a claim, as an
  inference process does (``--claim-only``: claims alone, which leases the
  table out, so give ``--lease-capacity`` room), and this process timing ``GET /queue-state``
  (``node.client.Client``, one keep-alive connection, back to back) for
  ``--seconds``: p50/p99 of the answer, and the claim rate in the same
  window. First ``--idle-seconds`` of the same timing with no claimer, as
  the baseline.

Results are printed as JSON lines and appended to bench/results/state.jsonl.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import queue as queue_mod
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import add_json_option, keep, key_of, percentile, write_json  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TARGET_MS = 1.0
NOW = 1_800_000_000.0  # minute-aligned
LOAD_CHUNK = 20_000  # rows per load_rows call, as keeper/feed.py walks
# (route, the route's cadence): the classes' routes.
ROUTES = (("pages", 3600), ("listings", 86400), ("feeds", 900))
# Row cadences beside the route's own (None): 6 hours, 7 days.
ROW_CADENCES = (None, 6 * 3600, 7 * 86400)
LAG_SAMPLES = 10_000
FLOW_MINUTES = 60


def _report(doc: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    line = json.dumps(keep({"at": time.strftime("%Y-%m-%dT%H:%M:%S"), **doc}))
    print(line, flush=True)
    with open(RESULTS / "state.jsonl", "a") as f:
        f.write(line + "\n")


def _ms_figures(seconds: list[float]) -> dict[str, Any]:
    ordered = sorted(seconds)
    out: dict[str, Any] = {"n": len(ordered)}
    for name, q in (("p50_ms", 0.5), ("p99_ms", 0.99)):
        value = percentile(ordered, q)
        out[name] = None if value is None else round(value * 1e3, 4)
    out["max_ms"] = round(ordered[-1] * 1e3, 4) if ordered else None
    return out


# -- doc: Keeper.counts_doc ------------------------------------------------------------


def bench_routes(classes: int) -> tuple[tuple[str, int], ...]:
    """The routes for about ``classes`` classes (6 a route: 3 cadences x the
    sitemap flag): ROUTES, then more with their cadences in turn."""
    more = max(0, -(-classes // 6) - len(ROUTES))
    return ROUTES + tuple((f"route{i}", ROUTES[i % len(ROUTES)][1]) for i in range(more))


def build_keeper(
    rows: int, late_days: float, ahead_days: float, seed: int = 1, classes: int = 18
) -> Any:
    """A live Keeper holding ``rows`` rows in ``classes`` classes (18: the 3
    routes of ROUTES), with full lag rings and an hour of flow, over a memory
    store (counts_doc reads no store)."""
    from keeper.process import FLOW_FIELDS, Keeper
    from node.core.config import Config, RouteConfig
    from node.store import open_store

    route_list = bench_routes(classes)
    routes = {name: RouteConfig(cadence_s=cadence) for name, cadence in route_list}
    config = Config(name="bench-state", data_dir=Path(tempfile.gettempdir()), routes=routes)
    keeper = Keeper(config, open_store("memory://"), ready=None, state=None)
    rnd = random.Random(seed)
    lo, span = NOW - late_days * 86400, (late_days + ahead_days) * 86400
    buckets = keeper.buckets
    buckets.reserve(rows)
    t0 = time.perf_counter()
    for start in range(0, rows, LOAD_CHUNK):
        chunk = []
        for i in range(start, min(rows, start + LOAD_CHUNK)):
            route, _cadence = route_list[rnd.randrange(len(route_list))]
            cadence_s = ROW_CADENCES[rnd.randrange(len(ROW_CADENCES))]
            sitemap = int(rnd.random() < 0.3)
            chunk.append((key_of(i), i + 1, route, cadence_s, sitemap, lo + rnd.random() * span))
        buckets.load_rows(chunk)
    load_s = time.perf_counter() - t0
    # As at the end of a load (keeper/feed.py _load_step).
    keeper._loading = False
    keeper.status = "live"
    keeper.exact = True
    keeper._start_received(NOW)
    for window in (keeper.stats.lag_node, keeper.stats.lag_outside):
        window.add_many((rnd.lognormvariate(-6.0, 1.0) for _ in range(LAG_SAMPLES)), NOW)
    first_minute = int(NOW // 60) - FLOW_MINUTES
    for m in range(FLOW_MINUTES):
        counts = {name: rnd.randrange(5000) for name in FLOW_FIELDS}
        keeper._flow.append((first_minute + m, counts))
    keeper.bench_load_s = load_s
    return keeper


def _parts(keeper: Any) -> dict[str, Callable[[float], Any]]:
    """The pieces of counts_doc, each callable at ``now`` (for the breakdown)."""
    from keeper.process import LATENESS_EDGES

    buckets = keeper.buckets
    return {
        "counts": buckets.counts,
        "coming": buckets.coming,
        "oldest_due": buckets.oldest_due,
        "lateness": lambda now: buckets.lateness(now, LATENESS_EDGES),
        "lateness_doc": lambda now: keeper._lateness_doc(
            now, buckets.oldest_due(now), buckets.counts(now)["per_class"]
        ),
        "lag_figures": lambda now: keeper.stats.lag_figures(),
        "flow_doc": lambda now: keeper._flow_doc(),
    }


def _time_calls(fn: Callable[[float], Any], start: float, calls: int, step_s: float) -> list[float]:
    out = []
    perf = time.perf_counter
    for i in range(calls):
        now = start + i * step_s
        t0 = perf()
        fn(now)
        out.append(perf() - t0)
    return out


def _profile(keeper: Any, start: float, calls: int, step_s: float) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        keeper.counts_doc(start + i * step_s)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    return text.getvalue()


def bench_doc(args: argparse.Namespace) -> int:
    import msgpack

    missed = False
    for rows in args.rows:
        keeper = build_keeper(rows, args.late_days, args.ahead_days, classes=args.classes)
        start = NOW + 1.0
        t0 = time.perf_counter()
        doc = keeper.counts_doc(start)
        first_ms = (time.perf_counter() - t0) * 1e3
        start += args.step_s
        steady = _time_calls(keeper.counts_doc, start, args.calls, args.step_s)
        # The same calls again at one fixed now (no minute advances).
        fixed = _time_calls(keeper.counts_doc, start, args.calls, 0.0)
        # Again with no lag samples (a keeper that applied no change lately).
        from keeper.lag import LagWindow

        saved = keeper.stats.lag_node, keeper.stats.lag_outside
        keeper.stats.lag_node, keeper.stats.lag_outside = LagWindow(), LagWindow()
        no_lag = _time_calls(keeper.counts_doc, start, args.calls, args.step_s)
        keeper.stats.lag_node, keeper.stats.lag_outside = saved
        parts = {
            name: _ms_figures(_time_calls(fn, start, args.calls, args.step_s))
            for name, fn in _parts(keeper).items()
        }
        packed = msgpack.packb(doc)
        parts["msgpack_packb"] = _ms_figures(
            _time_calls(lambda _now, d=doc: msgpack.packb(d), start, args.calls, 0.0)
        )
        figures = _ms_figures(steady)
        result = {
            "bench": "counts_doc",
            "rows": rows,
            "classes": len(keeper.classes),
            "due": doc["now"]["due"]["total"],
            "load_s": round(keeper.bench_load_s, 2),
            "calls": args.calls,
            "step_s": args.step_s,
            "first_call_ms": round(first_ms, 4),
            **figures,
            "fixed_now": _ms_figures(fixed),
            "without_lag_samples": _ms_figures(no_lag),
            "parts": parts,
            "doc_bytes": len(packed),
            "target_ms": TARGET_MS,
            "met": figures["p99_ms"] is not None and figures["p99_ms"] <= TARGET_MS,
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
        _report(result)
        if not result["met"]:
            missed = True
            print(f"counts_doc p99 {figures['p99_ms']} ms > {TARGET_MS} ms at {rows} rows; "
                  f"cProfile of {args.profile_calls} calls, by own time:", file=sys.stderr)
            print(_profile(keeper, start, args.profile_calls, args.step_s), file=sys.stderr)
        keeper = None  # free the buckets before the next size
    return 1 if missed and args.strict else 0


# -- http: GET /queue-state under claim load -------------------------------------------


def _claimer(cfg: dict, idx: int, ready: Any, go: Any, start: Any, out: Any) -> None:
    """One claimer process: LocalClaimer, claim(batch) in a loop until the
    deadline; with ``complete``, a result for every lease in one ledger call."""
    try:
        from node.client import LocalClaimer

        local = LocalClaimer(cfg["name"], data_dir=cfg["dir"], consumer=f"bench-state-{idx}")
        claimer = local.claimer
        ready.put(idx)
        go.wait()
        deadline = start.value + cfg["seconds"]
        while time.monotonic() < start.value:
            time.sleep(0.001)  # the common start, a few ms away
        grants = claims = empty = completed = 0
        first = last = None
        while True:
            t = time.monotonic()
            if t >= deadline:
                break
            generation = claimer.generation
            got = claimer.claim(cfg["batch"], cfg["lease_s"], local.consumer, time.time())
            claims += 1
            if not got:
                empty += 1
                claimer.wait_for_publish(generation, min(0.05, max(0.0, deadline - t)))
                continue
            grants += len(got)
            first = first if first is not None else t
            last = time.monotonic()
            if cfg["complete"]:
                done = local.complete_many([(g.lease_id, g.key, {"n": 1}) for g in got])
                completed += sum(1 for d in done if isinstance(d, int))
        local.close()
        out.put((idx, {"grants": grants, "claims": claims, "empty": empty,
                       "completed": completed, "first": first, "last": last}, None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        ready.put(idx)
        out.put((idx, None, traceback.format_exc()))


def _time_queue_state(client: Any, until: float) -> tuple[list[float], int, int]:
    """GET /queue-state back to back until ``until``: (latencies, vouched, not)."""
    lat: list[float] = []
    vouched = refused = 0
    perf = time.perf_counter
    while time.monotonic() < until:
        t0 = perf()
        doc = client.queue_state()
        lat.append(perf() - t0)
        if doc.get("trust", {}).get("vouched"):
            vouched += 1
        else:
            refused += 1
    return lat, vouched, refused


def _run_claimers(cfg: dict, procs: int, client: Any) -> tuple[list[dict], list[float], int, int]:
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    start = ctx.Value("d", 0.0)
    children = [ctx.Process(target=_claimer, args=(cfg, i, ready, go, start, out))
                for i in range(procs)]  # fmt: skip
    for p in children:
        p.start()
    try:
        for _ in children:
            ready.get(timeout=120)
        start.value = time.monotonic() + 0.3
        go.set()
        while time.monotonic() < start.value:
            time.sleep(0.001)  # the common start, a few ms away
        lat, vouched, refused = _time_queue_state(client, start.value + cfg["seconds"])
        results, errors = [], []
        while len(results) + len(errors) < procs:
            try:
                _idx, res, err = out.get(timeout=120)
            except queue_mod.Empty:
                raise RuntimeError("claimers did not report in time") from None
            (errors.append(err) if err else results.append(res))
        if errors:
            raise RuntimeError("a claimer failed:\n" + "\n".join(errors))
    finally:
        for p in children:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results, lat, vouched, refused


def bench_http(args: argparse.Namespace) -> int:
    from bench import bench_claims
    from bench.bench_claims import Node, template
    from node.client import Client

    rows = args.rows[0]
    db = template(rows)
    # bench_claims.Node starts the node with this many slots (its own default
    # leases a whole table); GET /queue-state counts the slots at every call.
    bench_claims.LEASE_CAPACITY = args.lease_capacity
    node = Node(db, workers=args.workers, ready_size=args.ready_size)
    client = Client(f"http://{node.http}")
    try:
        idle, idle_v, idle_r = _time_queue_state(client, time.monotonic() + args.idle_seconds)
        cfg = {"name": node.name, "dir": str(node.dir), "seconds": args.seconds,
               "batch": args.batch, "lease_s": 60.0, "complete": not args.claim_only}
        results, lat, vouched, refused = _run_claimers(cfg, args.procs, client)
        grants = sum(r["grants"] for r in results)
        empty = sum(r["empty"] for r in results)
        _report({
            "bench": "queue_state_http",
            "rows": rows,
            "workers": args.workers,
            "claimers": args.procs,
            "batch": args.batch,
            "complete": not args.claim_only,
            "lease_capacity": args.lease_capacity,
            "seconds": args.seconds,
            "idle": {**_ms_figures(idle), "vouched": idle_v, "not_vouched": idle_r},
            "under_load": {**_ms_figures(lat), "vouched": vouched, "not_vouched": refused,
                           "per_s": round(len(lat) / args.seconds, 1)},
            "grants": grants,
            "grants_per_s": round(grants / args.seconds, 1),
            "completed": sum(r["completed"] for r in results),
            "empty_claims": empty,
            "claims": sum(r["claims"] for r in results),
            "cpus": os.cpu_count(),
            "loadavg_1m": round(os.getloadavg()[0], 2),
        })
    finally:
        client.close()
        node.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/bench_state.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["doc", "http"])
    p.add_argument("--rows", type=int, nargs="+", default=None,
                   help="doc: 250000 1000000; http: 250000 (the first is used)")
    p.add_argument("--calls", type=int, default=500, help="doc: timed calls per size")
    p.add_argument("--step-s", type=float, default=5.0, help="doc: now moves on this much a call")
    p.add_argument("--late-days", type=float, default=21.0)
    p.add_argument(
        "--classes", type=int, default=18, help="doc: about this many classes (6 a route)"
    )
    p.add_argument("--ahead-days", type=float, default=3.0)
    p.add_argument("--profile-calls", type=int, default=200)
    p.add_argument("--strict", action="store_true", help="doc: exit 1 when the target is missed")
    p.add_argument("--seconds", type=float, default=10.0, help="http: the timed window")
    p.add_argument("--idle-seconds", type=float, default=3.0, help="http: the baseline")
    p.add_argument("--procs", type=int, default=2, help="http: claimer processes")
    p.add_argument("--batch", type=int, default=16, help="http: leases per claim")
    p.add_argument("--claim-only", action="store_true",
                   help="http: claim without completing (give --lease-capacity room for it)")
    p.add_argument("--lease-capacity", type=int, default=65_536,
                   help="http: the node's lease-table slots (the node's default 65,536)")
    p.add_argument("--workers", type=int, default=2, help="http: the node's HTTP workers")
    p.add_argument("--ready-size", type=int, default=5000)
    add_json_option(p)
    args = p.parse_args(argv)
    if args.rows is None:
        args.rows = [250_000, 1_000_000] if args.what == "doc" else [250_000]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    code = bench_doc(args) if args.what == "doc" else bench_http(args)
    write_json(args.json)
    return code


if __name__ == "__main__":
    sys.exit(main())
