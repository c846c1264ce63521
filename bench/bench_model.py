"""The cycle with a real model: all-MiniLM-L6-v2 through the node, against the model alone.

    .venv/bin/python bench/bench_model.py                # 100,000 rows: 20 min or more on 2 cores
    .venv/bin/python bench/bench_model.py --rows 5000    # a few minutes

It needs the model extra (``scripts/setup model``: PyTorch 2.13.0 and the
model's weights). Two measurements on the same texts (``rows`` sentences made
deterministically from ``--seed``), at the same batch size, in the same
number of processes, each with the same torch threads:

- ``model``: ``procs`` plain processes. Each sets up examples/embed_handler.py's
  ``Embedder`` and embeds its half of the texts (a contiguous share) in
  batches of ``batch`` with ``Embedder.embed``, the model alone. Timed from a
  common start, once every model is loaded, to the end of the last process.
- ``node``: ``python -m node run --handler embed_handler:Embedder
  --inference-procs procs`` with ``batch_size = batch``, one HTTP worker, on a
  fresh data directory. The node is paused while the rows (payload
  ``{"text": ...}``, job ``embed``) are written over ``POST /rows`` and until
  every inference process has loaded its model; the clock starts when
  ``POST /admin/resume`` returns and stops when this process, the receiver,
  has taken and acked the last result (``GET /jobs/embed/results?max=1000``
  long polls, then ``POST /jobs/embed/ack``). Every result is checked: 1,536
  bytes, a unit vector, each key once.

The figure: items/s of each and node / model (target at least 0.98, issue
16). ``--rounds R`` alternates the two R times (the machine is shared: compare
within a round) and reports each round's ratio and the median. Node CPU
seconds by process over the node's window say where the node's own work goes.
Each round is one JSON line, printed and appended to bench/results/model.jsonl;
``--json PATH`` writes the figures (name, value, unit, setup, machine).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
for _path in (ROOT, EXAMPLES):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench.bench_claims import _NodeCPU  # noqa: E402 - after the path fix above

RESULTS = ROOT / "bench" / "results"
HANDLER = "embed_handler:Embedder"
THREADS_ENV = "EMBED_HANDLER_THREADS"  # examples/embed_handler.py reads it
JOB = "embed"
ROUTE = "docs"
DIM = 384
RESULT_BYTES = DIM * 4  # float32
TARGET = 0.98
UPSERT_CHUNK = 5_000
TAKE_MAX = 1_000  # the receiver's poll
POLL_WAIT_S = 1.0
SETUP_TIMEOUT_S = 300.0  # loading the model in every process
MIN_RATE = 5.0  # items/s below which a run is taken as stuck (its deadline)
START_DELAY_S = 0.2

# The sentences: deterministic, of varied length (one to four clauses of 6
# to 9 words, so batches pad to different widths), from a small vocabulary.
_ADJ = (
    "quick quiet early late heavy light small large bright dark new old warm cold busy idle "
    "remote local careful sudden steady broken patient hidden"
).split()
_NOUN = (
    "queue node lease worker model vector result ledger keeper schedule server host card "
    "batch request receiver sentence document page listing report signal table river city "
    "market garden library station engine harbor"
).split()
_VERB = (
    "sends takes holds finds reads writes moves keeps checks answers builds counts drops "
    "carries watches follows opens closes"
).split()
_PREP = "across behind beside under over near through around before after".split()
_CLAUSE = "and then while because although so but".split()


def sentences(rows: int, seed: int = 1) -> list[str]:
    """``rows`` sentences, the same for the same (rows, seed) on any host."""
    rnd = random.Random(seed)
    out = []
    for i in range(rows):
        clauses = []
        for _ in range(rnd.choice((1, 1, 2, 2, 3, 4))):
            clauses.append(
                f"the {rnd.choice(_ADJ)} {rnd.choice(_NOUN)} {rnd.choice(_VERB)} the "
                f"{rnd.choice(_ADJ)} {rnd.choice(_NOUN)} {rnd.choice(_PREP)} the "
                f"{rnd.choice(_NOUN)}"
            )
        text = f" {rnd.choice(_CLAUSE)} ".join(clauses)
        out.append(f"{text[0].upper()}{text[1:]} (item {i}).")
    return out


def share(rows: int, procs: int, idx: int) -> tuple[int, int]:
    return idx * rows // procs, (idx + 1) * rows // procs


# -- the model alone ---------------------------------------------------------------------------


def _model_child(args: dict, idx: int, ready: Any, go: Any, start: Any, out: Any) -> None:
    try:
        os.environ[THREADS_ENV] = str(args["threads"])
        from embed_handler import Embedder

        lo, hi = share(args["rows"], args["procs"], idx)
        texts = sentences(args["rows"], args["seed"])[lo:hi]
        model = Embedder()
        model.setup("cpu")
        ready.put(idx)
        go.wait()
        wait = start.value - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # the common start
        batch = args["batch"]
        cpu0 = time.process_time()
        for i in range(0, len(texts), batch):
            model.embed(texts[i : i + batch])
        out.put((idx, time.monotonic(), len(texts), time.process_time() - cpu0, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        ready.put(idx)
        out.put((idx, 0.0, 0, 0.0, f"{type(exc).__name__}: {exc}"))


def run_model(args: argparse.Namespace) -> dict:
    """``procs`` plain processes embedding their halves: items/s."""
    ctx = mp.get_context("spawn")
    ready, out, go, start = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    cfg = {k: getattr(args, k) for k in ("rows", "procs", "batch", "threads", "seed")}
    children = [
        ctx.Process(target=_model_child, args=(cfg, i, ready, go, start, out))
        for i in range(args.procs)
    ]
    for p in children:
        p.start()
    try:
        for _ in children:
            ready.get(timeout=SETUP_TIMEOUT_S)
        start.value = time.monotonic() + START_DELAY_S
        go.set()
        deadline = args.rows / MIN_RATE + 60
        done = [out.get(timeout=deadline) for _ in children]
    finally:
        for p in children:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [err for *_, err in done if err]
    if errors:
        raise RuntimeError("a model process failed: " + "; ".join(errors))
    seconds = max(end for _, end, *_ in done) - start.value
    items = sum(n for _, _, n, *_ in done)
    cpu_s = sum(c for *_, c, _ in done)
    return {
        "items": items,
        "seconds": round(seconds, 3),
        "items_per_s": round(items / seconds, 2),
        "cpu_s": round(cpu_s, 3),
        "cpu_ms_per_item": round(cpu_s / items * 1e3, 3),
    }


# -- through the node --------------------------------------------------------------------------


def _rows(args: argparse.Namespace) -> list[dict]:
    return [
        {"key": f"doc-{i:07d}", "route": ROUTE, "job": JOB, "payload": {"text": text}}
        for i, text in enumerate(sentences(args.rows, args.seed))
    ]


def _check(results: list[dict], seen: set[str]) -> int:
    """Bad results of one poll (wrong size, not a unit vector, a key twice)."""
    import numpy as np

    bad = 0
    good = []
    for r in results:
        if not isinstance(r["result"], bytes) or len(r["result"]) != RESULT_BYTES:
            bad += 1
        elif r["key"] in seen:
            bad += 1
        else:
            good.append(r["result"])
        seen.add(r["key"])
    if good:
        vectors = np.frombuffer(b"".join(good), "<f4").reshape(len(good), DIM)
        bad += int((np.abs(np.linalg.norm(vectors, axis=1) - 1.0) > 1e-3).sum())
    return bad


def _wait_setup(node: Any, procs: int, timeout_s: float) -> None:
    """Until every inference process logged that its handler is set up."""
    from node.testing import wait_for

    def set_up() -> bool:
        node.check_alive()
        text = node.log_path.read_text(errors="replace")
        return text.count("action=inference_start") >= procs

    wait_for(set_up, timeout_s, "the inference processes' model setup")


def _wait_keeper_holds(client: Any, rows: int, timeout_s: float = 120.0) -> None:
    from node.testing import wait_for

    def holds() -> bool:
        state = client.queue_state()
        return bool(state.get("now", {}).get("due", {}).get("total", 0) >= rows)

    wait_for(holds, timeout_s, f"the keeper to hold {rows} due rows")


def run_node(args: argparse.Namespace) -> dict:
    """The node with the handler in ``procs`` inference processes: items/s,
    from resume to the last result acked."""
    from node.client import Client
    from node.testing import NodeProcess, finish

    data_dir = Path(tempfile.mkdtemp(prefix="qn-bench-model-"))
    name = f"bench-model-{uuid.uuid4().hex[:8]}"
    env = {
        THREADS_ENV: str(args.threads),
        "QUEUE_NODE_BATCH_SIZE": str(args.batch),
        "PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    node = NodeProcess(
        data_dir, name, "--handler", HANDLER, "--inference-procs", str(args.procs),
        env=env, workers=args.workers, test_hooks=False,
    )  # fmt: skip
    try:
        node.start(timeout_s=60)
        client = Client(node.base_url, timeout_s=60)
        client.pause()
        rows = _rows(args)
        for i in range(0, len(rows), UPSERT_CHUNK):
            client.upsert(rows[i : i + UPSERT_CHUNK])
        del rows
        _wait_keeper_holds(client, args.rows)
        _wait_setup(node, args.procs, SETUP_TIMEOUT_S)
        cpu = _NodeCPU(node.proc.pid if node.proc else None)
        cpu.mark(time.monotonic())
        client.resume()
        t0 = time.monotonic()
        deadline = t0 + args.rows / MIN_RATE + 60
        acked = bad = 0
        first_s = None
        seen: set[str] = set()
        while acked < args.rows:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {acked} of {args.rows} results after the deadline")
            results = client.poll(JOB, max=TAKE_MAX, wait_s=POLL_WAIT_S)
            if not results:
                node.check_alive()
                continue
            if first_s is None:
                first_s = time.monotonic() - t0
            bad += _check(results, seen)
            client.ack(JOB, [r["id"] for r in results])
            acked += len(results)
        seconds = time.monotonic() - t0
        cpu.stop()
        cpu_s = cpu.spent()  # by process title: read while they run
        accounting = client.accounting()
        client.close()
        status = node.stop(timeout_s=60)
    finally:
        finish([node], name)
    if status != 0:
        raise RuntimeError(f"the node exited {status}: see {node.log_path}")
    return {
        "items": acked,
        "distinct_keys": len(seen),
        "bad_results": bad,
        "seconds": round(seconds, 3),
        "items_per_s": round(acked / seconds, 2),
        "first_result_s": None if first_s is None else round(first_s, 3),
        "cpu_s": cpu_s,
        "inference_cpu_ms_per_item": round(
            sum(v for k, v in cpu_s.items() if k.startswith("infer")) / acked * 1e3, 3
        ),
        "node_cpu_ms_per_item": round(
            sum(v for k, v in cpu_s.items() if not k.startswith("infer")) / acked * 1e3, 3
        ),
        "released": accounting.get("released"),
        "expired": accounting.get("expired"),
        "balanced": accounting.get("balanced"),
        "log": str(node.log_path),
    }


# -- the report --------------------------------------------------------------------------------


def report(doc: dict, results: Path = RESULTS) -> None:
    results.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%S"), **doc})
    print(line, flush=True)
    with open(results / "model.jsonl", "a") as f:
        f.write(line + "\n")


def records(rounds: list[dict], args: argparse.Namespace) -> list[dict]:
    """One record a figure: name, value, unit, setup, machine."""
    machine = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "note": "shared machine",
    }
    setup = {k: getattr(args, k) for k in ("rows", "procs", "batch", "threads", "workers")}
    setup.update(model="all-MiniLM-L6-v2", device="cpu", result_bytes=RESULT_BYTES)
    last = rounds[-1]
    out = [
        {"name": "model.direct.items_per_s", "value": last["model"]["items_per_s"]},
        {"name": "model.node.items_per_s", "value": last["node"]["items_per_s"]},
        {"name": "model.ratio.node_over_model", "value": median_ratio(rounds), "unit": "x"},
        {
            "name": "model.ratio.cpu_model_over_node",
            "value": round(statistics.median(r["cpu_ratio"] for r in rounds), 4),
            "unit": "x",
        },
    ]
    for r in out:
        r.setdefault("unit", "items/s")
        r.update(setup=setup, machine=machine)
    return out


def median_ratio(rounds: list[dict]) -> float:
    return round(statistics.median(r["ratio"] for r in rounds), 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/bench_model.py", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=100_000, help="texts (100,000)")
    p.add_argument("--procs", type=int, default=2, help="inference / model processes (2)")
    p.add_argument("--batch", type=int, default=32, help="texts a forward pass (32)")
    p.add_argument(
        "--threads", type=int, default=max(1, (os.cpu_count() or 1) // 2),
        help="torch CPU threads a process (the cores over --procs)",
    )  # fmt: skip
    p.add_argument("--workers", type=int, default=1, help="the node's HTTP workers (1)")
    p.add_argument(
        "--rounds", type=int, default=1, help="model and node, alternated, this many times"
    )
    p.add_argument("--seed", type=int, default=1, help="of the sentences")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.threads * args.procs > (os.cpu_count() or 1):
        print(f"note: {args.procs} x {args.threads} threads over {os.cpu_count()} cores")
    rounds = []
    for n in range(args.rounds):
        # Alternated, so neither always runs on the machine the other warmed.
        if n % 2:
            node = run_node(args)
            model = run_model(args)
        else:
            model = run_model(args)
            node = run_node(args)
        ratio = node["items_per_s"] / model["items_per_s"]
        # CPU a item, the model's over the node's (its inference processes and
        # its own): the rate the node would keep where the CPU is all there is,
        # less moved by other load on the machine than the wall-clock ratio.
        node_ms = node["inference_cpu_ms_per_item"] + node["node_cpu_ms_per_item"]
        cpu_ratio = model["cpu_ms_per_item"] / node_ms
        doc = {"round": n, "rows": args.rows, "procs": args.procs, "batch": args.batch,
               "threads": args.threads, "model": model, "node": node, "ratio": round(ratio, 4),
               "cpu_ratio": round(cpu_ratio, 4),
               "loadavg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip
        report(doc)
        rounds.append(doc)
    print("\nround   model items/s   node items/s   node / model   target   by CPU a item")
    for r in rounds:
        mark = "ok" if r["ratio"] >= TARGET else "MISS"
        print(
            f"{r['round']:>5} {r['model']['items_per_s']:>15.1f} {r['node']['items_per_s']:>14.1f}"
            f" {r['ratio']:>14.3f}   {TARGET} {mark:<4} {r['cpu_ratio']:>8.3f}"
        )
    if len(rounds) > 1:
        print(f"median ratio {median_ratio(rounds):.3f}")
    if args.json:
        args.json.write_text(json.dumps(records(rounds, args), indent=1) + "\n")
        print(f"figures -> {args.json}")
    bad = sum(r["node"]["bad_results"] for r in rounds)
    if bad:
        print(f"BAD: {bad} results were not one unit vector a key", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
