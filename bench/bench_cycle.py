"""The whole work cycle, the node and its peers, in one run.

    .venv/bin/python bench/bench_cycle.py --batch 1 64 --seconds 15
    .venv/bin/python bench/bench_cycle.py --quick          # 20,000 rows, 5 s: about a minute

The cycle: ``procs`` claimer processes (2) loop claim(batch) then complete
every claimed item with a 200-byte result; one receiver process takes the
job's delivered results, up to 1,000 at a time, and acks them. The figure is
completed-and-acked items/s over the window, and the cycle's p50/p99 per
batch (claim start → completion answered). Every peer runs the same
processes on the same rows: ``rows`` due rows (200,000) with keys of about 55
characters (``bench/claims_external.py``'s keys, due times and payloads).

- ``node_local``: a node (``python -m node run``, embedded SQLite, a fresh
  data directory per run); each claimer a ``LocalClaimer``: ``claim(batch,
  wait_s=0.05)`` then ``complete_many`` of the batch.
- ``node_http``: the same node over HTTP through ``node.client.Client`` on
  the ``--wire`` (msgpack, its default, or JSON): ``claim(batch)``, then
  ``complete_many`` (``POST /complete {"items": [...]}``) when the node takes
  the batch form (probed once before the clock: a 400 means it does not) and
  one ``POST /complete`` per result otherwise; the output says which.
- the node's receiver: ``GET /jobs/j/results?max=1000&wait_s=0.2``, then
  ``POST /jobs/j/ack`` of their ids. After the window the receiver drains
  what was completed, and the run checks that every completion answered ok
  was acked (``lost`` must be 0).
- ``postgres`` and ``redis``: ``bench/cycle_peers.py`` (PostgreSQL SKIP
  LOCKED with ``synchronous_commit`` on; Redis, not durable). A peer that
  cannot start (no server, no driver) is reported as not run, with why.

Stop rule: a claimer stops at the deadline; a peer's claimer also at its
first empty claim (its rows ran out), the node's once it found nothing for
``DRAINED_S`` (the ready set can be empty for a moment between publishes).
The window ends at the deadline, or, when the rows ran out, when the receiver
took the last completion; the rate counts the items acked within it.

Each run is one JSON line, printed and appended to bench/results/cycle.jsonl;
``--json PATH`` writes the figures (name, value, unit, setup, machine).
``--repeat N`` runs N rounds, every peer once a round in turn (the node and
its peer meet the same moment of a shared machine's load); a ratio is then
the median of the rounds' ratios, a figure the median of its runs, and
``setup.rounds`` keeps each.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import sys
import time
import traceback
from array import array
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import bench_claims  # noqa: E402 - after the path fix above
from bench.bench_claims import Node, _NodeCPU, pg_backends_cpu  # noqa: E402
from bench.claims_external import RESULTS, _percentile  # noqa: E402
from bench.cycle_peers import LEASE_S, PEERS, TAKE_MAX  # noqa: E402

JOB = "j"
RESULT = bytes(range(200))  # the 200-byte result of every completion
RESULT_B64 = base64.b64encode(RESULT).decode()
ITEM_BYTES = {"result": RESULT_B64, "encoding": "base64"}  # a batch item's result
ITEM_JSON = {"result": "r" * 200}  # the same where the batch form takes no encoding
NODE_PATHS = ("node_local", "node_http")
VARIANTS = (*NODE_PATHS, *PEERS)
DRAINED_S = 2.0  # a node claimer that found nothing for this long: the rows ran out
LOCAL_WAIT_S = 0.05  # LocalClaimer.claim(wait_s): wait for the keeper's next publish
HTTP_EMPTY_WAIT_S = 0.002  # an HTTP claim that got nothing tries again after this
POLL_WAIT_S = 0.2  # the node receiver's long poll
TAKE_IDLE_S = 0.001  # a peer's receiver that found nothing looks again after this
DRAIN_IDLE_S = 5.0  # after the window: the receiver stops once nothing came for this long
DRAIN_MAX_S = 60.0
START_DELAY_S = 0.3
# Targets (issue 16): the node's completed-and-acked/s over PostgreSQL's.
TARGETS = {("node_local", 64): 5.0, ("node_local", 1): 1.5, ("node_http", 64): 1.5}
MINIMUM = {("node_local", 64): 3.0}


def template(rows: int, results: Path = RESULTS, scattered: bool = False) -> Path:
    """A SQLite schedule of ``rows`` due rows of job ``j``, made once and kept
    (the claim bench's rows, all of one job)."""
    return bench_claims.template(rows, results, name="cycle", job=JOB, scattered=scattered)


# -- the node's roles (in the claimer and receiver processes) --------------------------------


def _node_local_claimer(cfg: dict, idx: int, batch: int, result: bytes) -> Any:
    from node.client import LocalClaimer

    local = LocalClaimer(cfg["name"], data_dir=cfg["dir"], consumer=f"cycle-{idx}")

    def cycle() -> tuple[int, int, list[int], float]:
        t0 = time.monotonic()  # _cycle_loop's clock: the rest is its time less this
        grants = local.claim(batch, LEASE_S, wait_s=LOCAL_WAIT_S)
        claim_s = time.monotonic() - t0
        if not grants:
            return 0, 0, [], claim_s
        done = local.complete_many([(g.lease_id, g.key, result) for g in grants])
        ids = [d for d in done if type(d) is int]
        return len(grants), len(ids), ids, claim_s

    return cycle, local.close


def _client(cfg: dict) -> Any:
    """The node's Python client on the run's wire (``--wire``; a build
    before the wire option speaks JSON)."""
    from node.client import Client

    try:
        return Client(f"http://{cfg['http']}", wire=cfg["wire"])
    except TypeError:  # no wire option: JSON
        return Client(f"http://{cfg['http']}")


def _node_http_claimer(cfg: dict, idx: int, batch: int, result: bytes) -> Any:
    from node.client import ClientError

    client = _client(cfg)
    consumer = f"cycle-{idx}"
    client.request("GET", "/healthz")  # connected before the clock starts
    mode = cfg["complete_mode"]
    item_result = ITEM_JSON if mode == "batch_json" else ITEM_BYTES

    def complete_each(grants: list) -> list[int]:
        ids = []
        for g in grants:
            try:
                ids.append(client.complete(g.lease_id, g.key, result))
            except ClientError:
                pass  # refused: counted as not completed
        return ids

    def complete_many(grants: list) -> list[int]:
        done = client.complete_many([(g.lease_id, g.key, result) for g in grants])
        return [d for d in done if type(d) is int]

    def complete_batch(grants: list) -> list[int]:
        items = [{"lease_id": g.lease_id, "key": g.key, **item_result} for g in grants]
        answer = client.request("POST", "/complete", {"items": items})
        return [
            a["id"]
            for a in answer["items"]
            if a.get("outcome", a.get("status")) == "ok" and type(a.get("id")) is int
        ]

    def cycle() -> tuple[int, int, list[int], float]:
        t0 = time.monotonic()  # _cycle_loop's clock: the rest is its time less this
        grants = client.claim(batch, LEASE_S, consumer)
        claim_s = time.monotonic() - t0
        if not grants:
            time.sleep(HTTP_EMPTY_WAIT_S)  # no long poll on /claim
            return 0, 0, [], claim_s
        if mode == "single":
            ids = complete_each(grants)
        elif mode == "batch" and hasattr(client, "complete_many"):
            ids = complete_many(grants)  # what a user calls: bytes raw on the msgpack wire
        else:
            ids = complete_batch(grants)
        return len(grants), len(ids), ids, claim_s

    return cycle, client.close


def _node_receiver(cfg: dict) -> Any:
    client = _client(cfg)
    client.request("GET", "/healthz")

    def take() -> tuple[int, list[int]]:
        results = client.poll(JOB, max=TAKE_MAX, wait_s=POLL_WAIT_S)
        if not results:
            return 0, []
        ids = [r["id"] for r in results]
        client.ack(JOB, ids)
        return len(ids), ids

    return take, client.close


def probe_complete_form(http: str) -> tuple[str, str]:
    """Whether the node takes ``POST /complete {"items": [...]}``: one item on
    a lease that does not exist (a batch answers it ``unknown``; a node
    without the batch form refuses the body with a 400). Tried with the
    result as base64 bytes, then as a JSON string (a batch form that takes
    no per-item ``encoding``). (mode, why)."""
    from node.client import Client, ClientError

    probe = {"lease_id": 1, "key": "qn-bench-cycle-probe"}
    refused = ""
    with Client(f"http://{http}") as client:
        for mode, item in (("batch", ITEM_BYTES), ("batch_json", ITEM_JSON)):
            try:
                client.request("POST", "/complete", {"items": [{**probe, **item}]})
            except ClientError as exc:
                if exc.status != 400:
                    raise
                refused = f"the batch form answered 400 {exc.code}" + (
                    f" ({exc.field})" if exc.field else ""
                )
                continue
            kind = "base64 bytes" if mode == "batch" else "a 200-character JSON string"
            return mode, f"POST /complete {{items}}, one request a batch, results as {kind}"
    return "single", f"one POST /complete per result ({refused})"


CLAIMERS: dict[str, Any] = {
    "node_local": _node_local_claimer,
    "node_http": _node_http_claimer,
    **{name: roles[1] for name, roles in PEERS.items()},
}
RECEIVERS: dict[str, Any] = {
    "node_local": _node_receiver,
    "node_http": _node_receiver,
    **{name: roles[2] for name, roles in PEERS.items()},
}


# -- the processes ---------------------------------------------------------------------------


def _cycle_loop(cycle: Any, start_at: float, seconds: float, node: bool) -> dict:
    lat, claim_lat, ids = array("d"), array("d"), array("q")
    granted = completed = cycles = empty = 0
    now = time.monotonic()
    if start_at > now:
        time.sleep(start_at - now)
    deadline = start_at + seconds
    t = last_done = time.monotonic()
    cpu0 = time.process_time()
    drained = False
    while t < deadline:
        n, done, got, claim_s = cycle()
        t2 = time.monotonic()
        cycles += 1
        if n:
            lat.append(t2 - t)
            claim_lat.append(claim_s)
            granted += n
            completed += done
            ids.extend(got)
            last_done = t2
        else:
            empty += 1
            if not node or t2 - last_done > DRAINED_S:
                drained = True
                break
        t = t2
    return {
        "granted": granted,
        "completed": completed,
        "cycles": cycles,
        "empty": empty,
        "drained": drained,
        "stopped_at": (last_done if drained else t) - start_at,
        "lat": lat.tobytes(),
        "claim_lat": claim_lat.tobytes(),
        "ids": ids.tobytes(),
        "cpu_s": time.process_time() - cpu0,  # this claimer's own CPU over its loop
    }


def _claimer_child(kind, cfg, idx, batch, seconds, ready, go, start, out) -> None:
    try:
        cycle, close = CLAIMERS[kind](cfg, idx, batch, RESULT)
        ready.put(idx)
        go.wait()
        res = _cycle_loop(cycle, start.value, seconds, kind in NODE_PATHS)
        close()
        out.put(("claimer", idx, res, None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("claimer", idx, None, traceback.format_exc()))
        ready.put(idx)


def _receiver_child(kind, cfg, ready, go, start, stop, expected, out) -> None:
    try:
        take, close = RECEIVERS[kind](cfg)
        ready.put(-1)
        go.wait()
        start_at = start.value
        if start_at > time.monotonic():
            time.sleep(start_at - time.monotonic())
        times, counts, ids = array("d"), array("q"), array("q")
        taken, last_take, stop_seen = 0, time.monotonic(), None
        cpu0, cpu_s = time.process_time(), None
        while True:
            n, got = take()
            t = time.monotonic()
            if n:
                taken += n
                times.append(t - start_at)
                counts.append(n)
                ids.extend(got)
                last_take = t
            else:
                time.sleep(TAKE_IDLE_S)  # a bench's poll interval, not synchronisation
            if stop.is_set():
                if stop_seen is None:  # the claimers' loops are over: the window's CPU
                    cpu_s = time.process_time() - cpu0
                stop_seen = stop_seen or t
                if taken >= expected.value:
                    break
                if t - max(last_take, stop_seen) > DRAIN_IDLE_S or t - stop_seen > DRAIN_MAX_S:
                    break
        close()
        res = {"taken": taken, "times": times.tobytes(), "counts": counts.tobytes(),
               "cpu_s": cpu_s}  # fmt: skip
        out.put(("receiver", -1, {**res, "ids": ids.tobytes()}, None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("receiver", -1, None, traceback.format_exc()))
        ready.put(-1)


def _collect(out: Any, want: int, timeout_s: float, what: str) -> list[dict]:
    got, errors = [], []
    deadline = time.monotonic() + timeout_s
    while len(got) + len(errors) < want:
        try:
            _role, _idx, res, err = out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue_mod.Empty:
            raise RuntimeError(f"{what} did not report in time") from None
        (errors.append(err) if err else got.append(res))
    if errors:
        raise RuntimeError(f"{what} failed:\n" + "\n".join(errors))
    return got


def measure(kind: str, cfg: dict, batch: int, procs: int, seconds: float, pid: int | None) -> dict:
    """``procs`` claimers and one receiver, started together; the figures."""
    load_1m = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    start, expected = ctx.Value("d", 0.0), ctx.Value("q", 0)
    children = [
        ctx.Process(
            target=_claimer_child, args=(kind, cfg, i, batch, seconds, ready, go, start, out)
        )
        for i in range(procs)
    ]
    children.append(
        ctx.Process(target=_receiver_child, args=(kind, cfg, ready, go, start, stop, expected, out))
    )
    node_cpu = _NodeCPU(pid)
    for p in children:
        p.start()
    try:
        for _ in children:
            ready.get(timeout=120)
        if pid is None and "dsn" in cfg:  # PostgreSQL: its backends serving the bench
            node_cpu = pg_backends_cpu(cfg["dsn"], cfg["db"])
        start.value = time.monotonic() + START_DELAY_S
        go.set()
        node_cpu.mark(start.value)
        claimers = _collect(out, procs, START_DELAY_S + seconds + 120, f"{kind}: a claimer")
        node_cpu.stop()
        expected.value = sum(r["completed"] for r in claimers)
        stop.set()
        (receiver,) = _collect(out, 1, DRAIN_MAX_S + 60, f"{kind}: the receiver")
    finally:
        for p in children:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    res = _figures(kind, claimers, receiver, seconds)
    res.update(batch=batch, procs=procs, cpus=os.cpu_count(), loadavg_1m=round(load_1m, 2))
    # CPU seconds over the claimers' loops: the node's processes by title,
    # then the bench's own claimers (together) and receiver.
    res["cpu_s"] = node_cpu.spent()
    res["cpu_s"]["claimers"] = round(sum(r["cpu_s"] for r in claimers), 3)
    if receiver["cpu_s"] is not None:
        res["cpu_s"]["receiver"] = round(receiver["cpu_s"], 3)
    return res


def _arr(kind: str, raw: bytes) -> array:
    a = array(kind)
    a.frombytes(raw)
    return a


def _figures(kind: str, claimers: list[dict], receiver: dict, seconds: float) -> dict:
    lat = sorted(x for r in claimers for x in _arr("d", r["lat"]))
    # Each cycle's claim, and the rest of it (the completion and what the
    # claimer does between), cycle by cycle.
    claims, rests = [], []
    for r in claimers:
        for t, c in zip(_arr("d", r["lat"]), _arr("d", r["claim_lat"]), strict=True):
            claims.append(c)
            rests.append(t - c)
    claim_p50, rest_p50 = _percentile(sorted(claims), 0.5), _percentile(sorted(rests), 0.5)
    completed = sum(r["completed"] for r in claimers)
    drained = any(r["drained"] for r in claimers)
    claim_window = max(r["stopped_at"] for r in claimers)
    times, counts = _arr("d", receiver["times"]), _arr("q", receiver["counts"])
    window = claim_window
    if drained:  # to the receiver's take of the last completion
        total = 0
        for t, n in zip(times, counts, strict=True):
            total += n
            window = max(window, t)
            if total >= completed:
                break
    acked = sum(n for t, n in zip(times, counts, strict=True) if t <= window)
    p50, p99 = _percentile(lat, 0.5), _percentile(lat, 0.99)
    res: dict[str, Any] = {
        "variant": kind,
        "acked_per_s": round(acked / window, 1) if window > 0 else 0.0,
        "p50_ms": None if p50 is None else round(p50 * 1e3, 3),
        "p99_ms": None if p99 is None else round(p99 * 1e3, 3),
        "claim_p50_ms": None if claim_p50 is None else round(claim_p50 * 1e3, 3),
        "complete_p50_ms": None if rest_p50 is None else round(rest_p50 * 1e3, 3),
        "seconds": round(window, 3),
        "acked_in_window": acked,
        "granted": sum(r["granted"] for r in claimers),
        "completed": completed,
        "completed_per_s": round(completed / claim_window, 1) if claim_window > 0 else 0.0,
        "taken": receiver["taken"],
        "cycles": sum(r["cycles"] for r in claimers),
        "empty_claims": sum(r["empty"] for r in claimers),
        "drained": drained,
    }
    res["refused"] = res["granted"] - completed
    if kind in NODE_PATHS:  # every completion answered ok was acked, id by id
        ok = {i for r in claimers for i in _arr("q", r["ids"])}
        acked_ids = set(_arr("q", receiver["ids"]))
        res["lost"] = len(ok - acked_ids)
        res["acked_not_answered"] = len(acked_ids - ok)
        res["offered_twice"] = receiver["taken"] - len(acked_ids)
        res["distinct_ok_ids"] = len(ok)
    else:
        res["lost"] = max(0, completed - receiver["taken"])
    return res


# -- the runs --------------------------------------------------------------------------------


def run_node(kind: str, db: Path, rows: int, batch: int, args: Any) -> dict:
    node = Node(db, workers=args.workers, ready_size=args.ready_size)
    try:
        cfg = {"name": node.name, "dir": str(node.dir), "http": node.http, "wire": args.wire}
        cfg["complete_mode"], why = "local", "LocalClaimer.complete_many (one ledger request)"
        if kind == "node_http":
            cfg["complete_mode"], why = probe_complete_form(node.http)
            if cfg["complete_mode"] == "batch":
                how = "raw bytes in msgpack" if args.wire == "msgpack" else "base64 bytes in JSON"
                why = f"Client.complete_many: POST /complete {{items}} a batch, results as {how}"
        res = measure(kind, cfg, batch, args.procs, args.seconds, node.proc.pid)
        res.update(rows=rows, complete=why, workers=args.workers, ready_size=args.ready_size,
                   wire=args.wire, due_order=args.due_order)  # fmt: skip
        return res
    finally:
        node.stop()


def run_peer(name: str, rows: int, batch: int, args: Any) -> dict:
    setup, _claimer, _receiver, teardown, info = PEERS[name]
    t0 = time.perf_counter()
    cfg = setup(rows, scattered=args.due_order == "scattered")
    try:
        setup_s = time.perf_counter() - t0
        res = measure(name, cfg, batch, args.procs, args.seconds, None)
        res.update(rows=rows, setup_s=round(setup_s, 2), due_order=args.due_order, **info(cfg))
        return res
    finally:
        teardown(cfg)


def report(doc: dict, results: Path = RESULTS) -> None:
    results.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%S"), **doc})
    print(line, flush=True)
    with open(results / "cycle.jsonl", "a") as f:
        f.write(line + "\n")


def _print_split(results: list[dict]) -> None:
    print("\na batch's cycle, p50 ms: the claim, and the rest (the completion)")
    for r in results:
        if "not_run" in r or r.get("claim_p50_ms") is None:
            continue
        print(f"{r['variant']:<13} {r['batch']:>5}   claim {r['claim_p50_ms']}"
              f"  complete {r['complete_p50_ms']}")  # fmt: skip


def table(results: list[dict]) -> list[dict]:
    """Prints the figures and the node/peer ratios; answers the ratios."""
    print("\npeer          batch   acked/s    p50 ms    p99 ms   completed   acked    lost  note")
    for r in results:
        if "not_run" in r:
            print(f"{r['variant']:<13} {r['batch']:>5}   not run: {r['not_run']}")
            continue
        note = r.get("complete", "") if r["variant"] == "node_http" else ""
        note += " drained" if r["drained"] else ""
        note += f" round {r['rep'] + 1}" if "rep" in r else ""
        print(
            f"{r['variant']:<13} {r['batch']:>5} {r['acked_per_s']:>9.0f} {r['p50_ms']!s:>9} "
            f"{r['p99_ms']!s:>9} {r['completed']:>11} {r['taken']:>7} {r['lost']:>7}  {note}"
        )
    if any(r.get("autovacuum") == "off" for r in results):
        # The queue's dead rows then pile up through the run (the completions'
        # updates, the receiver's deletes): no vacuum costs the peer CPU in a
        # short window, but it slows as it goes, and a long window can stall
        # its receiver for good (docs/performance.md).
        print("note: this PostgreSQL server runs with autovacuum off (a default one has it"
              " on): no vacuum slows the postgres peer in a short window; a long one"
              " stalls it")
    _print_split(results)
    print("\nCPU a completed item, µs (each process over the claimers' loops)")
    for r in results:
        if "not_run" in r or not r.get("cpu_s") or not r["completed"]:
            continue
        spent = {k: v for k, v in r["cpu_s"].items() if v > 0}
        parts = "  ".join(f"{k} {v * 1e6 / r['completed']:.1f}" for k, v in spent.items())
        total = sum(spent.values()) * 1e6 / r["completed"]
        print(f"{r['variant']:<13} {r['batch']:>5}   {parts}  | all {total:.1f}")
    ratios = []
    by = {(r["variant"], r["batch"], r.get("rep", 0)): r for r in results if "not_run" not in r}
    reps = sorted({r.get("rep", 0) for r in results})
    print("\nratio (completed-and-acked/s)            batch     x   target"
          + ("   (each round's, x their median)" if len(reps) > 1 else ""))  # fmt: skip
    for batch in sorted({r["batch"] for r in results}):
        for node, peer in (
            ("node_local", "postgres"),
            ("node_http", "postgres"),
            ("node_local", "redis"),
            ("node_http", "redis"),
        ):
            runs = []  # the node's and the peer's runs of the same round, paired
            for rep in reps:
                a, b = by.get((node, batch, rep)), by.get((peer, batch, rep))
                if a is not None and b is not None and b["acked_per_s"]:
                    runs.append(a["acked_per_s"] / b["acked_per_s"])
            if not runs:
                continue
            x = median(runs)
            want = TARGETS.get((node, batch)) if peer == "postgres" else None
            mark = ""
            if want is not None:
                least = MINIMUM.get((node, batch))
                ok = "ok" if x >= want else ("at least" if least and x >= least else "MISS")
                mark = f"{want:>4} {ok}" + (f" (at least {least})" if least else "")
            each = "   (" + ", ".join(f"{v:.2f}" for v in runs) + ")" if len(reps) > 1 else ""
            print(f"{node + ' / ' + peer:<40} {batch:>5} {x:>6.2f}   {mark}{each}")
            ratios.append({"node": node, "peer": peer, "batch": batch, "x": round(x, 3),
                           "runs": [round(v, 3) for v in runs]})  # fmt: skip
    return ratios


def records(results: list[dict], ratios: list[dict], args: Any) -> list[dict]:
    """One record a figure: name, value, unit, setup, machine."""
    machine = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "note": f"{args.repeat} round(s), shared machine",
    }
    base = {"rows": args.rows, "procs": args.procs, "seconds": args.seconds,
            "result_bytes": len(RESULT), "receiver_max": TAKE_MAX,
            "due_order": args.due_order}  # fmt: skip
    out = []
    groups: dict[tuple[str, int], list[dict]] = {}  # a peer's runs at a batch, every round
    for r in results:
        groups.setdefault((r["variant"], r["batch"]), []).append(r)
    for (variant, batch), runs in groups.items():
        ran = [r for r in runs if "not_run" not in r]
        r = ran[0] if ran else runs[0]
        setup = {**base, "batch": batch}
        for k in ("complete", "postgres", "synchronous_commit", "autovacuum", "redis", "durable",
                  "loadavg_1m"):
            if k in r:
                setup[k] = r[k]
        name = f"cycle.{variant}.batch{batch}"
        if not ran:
            out.append({"name": f"{name}.acked_per_s", "value": None, "unit": "items/s",
                        "setup": setup, "machine": machine, "not_run": r["not_run"]})  # fmt: skip
            continue
        if len(runs) > 1:  # --repeat: each figure the median of the rounds, every round kept
            setup["rounds"] = [r["acked_per_s"] for r in ran]
        for field, unit in (("acked_per_s", "items/s"), ("p50_ms", "ms"), ("p99_ms", "ms"),
                            ("claim_p50_ms", "ms"), ("complete_p50_ms", "ms"),
                            ("lost", "items")):  # fmt: skip
            values = [r[field] for r in ran if r.get(field) is not None]
            value = sum(values) if field == "lost" else (median(values) if values else None)
            out.append({"name": f"{name}.{field}", "value": value, "unit": unit,
                        "setup": setup, "machine": machine})  # fmt: skip
    for x in ratios:
        setup = {**base, "batch": x["batch"]}
        if len(x["runs"]) > 1:
            setup["rounds"] = x["runs"]
        out.append({"name": f"cycle.ratio.{x['node']}_over_{x['peer']}.batch{x['batch']}",
                    "value": x["x"], "unit": "x", "setup": setup, "machine": machine})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/bench_cycle.py", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=None, help="due rows (200,000; --quick 20,000)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--procs", type=int, default=2, help="claimer processes (plus one receiver)")
    p.add_argument("--seconds", type=float, default=None, help="the window (15; --quick 5)")
    p.add_argument("--quick", action="store_true", help="20,000 rows, 5 s: about a minute")
    p.add_argument("--peers", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument(
        "--repeat", type=int, default=1,
        help="rounds, each peer once a round: the median of the rounds' ratios",
    )  # fmt: skip
    p.add_argument("--workers", type=int, default=2, help="the node's HTTP workers")
    p.add_argument("--wire", choices=["msgpack", "json"], default="msgpack",
                   help="node.client.Client's wire (the HTTP claimers and the receiver)")
    p.add_argument("--ready-size", type=int, default=5000)
    p.add_argument(
        "--due-order", choices=["keys", "scattered"], default="keys",
        help="the rows' due order: the keys' (the most overdue rows adjacent in the"
        " schedule's key index, so a batch's write-backs share pages) or scattered"
        " over them, as real items' due times are (every peer seeded alike)",
    )  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument(
        "--results", type=Path, default=RESULTS, help="the template and cycle.jsonl's folder"
    )
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    args.rows = args.rows or (20_000 if args.quick else 200_000)
    args.seconds = args.seconds or (5.0 if args.quick else 15.0)
    scattered = args.due_order == "scattered"
    db = (
        template(args.rows, args.results, scattered)
        if any(v in NODE_PATHS for v in args.peers)
        else None
    )
    results: list[dict] = []
    # Every round runs each peer once, in turn, so the node's and its peer's
    # runs of a round meet the same moment of a shared machine's load.
    rounds = [(batch, rep, kind) for batch in args.batch for rep in range(args.repeat)
              for kind in args.peers]  # fmt: skip
    for batch, rep, kind in rounds:
        try:
            if kind in NODE_PATHS:
                assert db is not None
                res = run_node(kind, db, args.rows, batch, args)
            else:
                res = run_peer(kind, args.rows, batch, args)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot start is reported
            if kind in NODE_PATHS:
                raise
            res = {"variant": kind, "batch": batch, "not_run": f"{type(exc).__name__}: {exc}"}
            res["not_run"] = res["not_run"].strip().splitlines()[0][:200]
        if args.repeat > 1:
            res["rep"] = rep
        report(res, args.results)
        results.append(res)
    ratios = table(results)
    if args.json:
        args.json.write_text(json.dumps(records(results, ratios, args), indent=1) + "\n")
        print(f"figures -> {args.json}")
    lost = sum(r.get("lost", 0) for r in results if r["variant"] in NODE_PATHS)
    if lost:
        print(f"LOST: {lost} completions answered ok were never acked", file=sys.stderr)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
