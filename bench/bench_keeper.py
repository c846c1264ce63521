"""Keeper figures for issue 2, measured on a real SQLite file.

    .venv/bin/python bench/bench_keeper.py feed    --rows 250000
    .venv/bin/python bench/bench_keeper.py startup --rows 250000
    .venv/bin/python bench/bench_keeper.py load    --rows 1000000
    .venv/bin/python bench/bench_keeper.py lag     --rows 250000 --rate 15000 --seconds 10

- feed: keeper work per applied change, reading the change feed included
  (a burst of mixed inserts, updates and deletes, applied by drain_feed);
- startup: time from the exec of `python -m node run` to the first publish
  and to live-and-exact;
- load: the keeper's load alone, in this process (a Keeper ticked until
  live): wall and CPU time, the longest tick and the longest publish;
- lag: commit-to-applied lag p50/p99 while a producer writes through the
  node's HTTP API at --rate rows/s and another program writes the file
  directly: as the keeper itself measures it (apply time minus the time the
  change was logged, its statement's time, before the commit), and from the
  writer's commit returning (``from_commit``): a probe writes one row every
  --probe-ms through the node's own store code (the HTTP worker's write:
  ``Store.upsert``, then the keeper's wake), reads its change's seq, and
  polls the state buffer's ``applied_seq`` until the keeper has applied it
  (polled every ~50 µs; a later change read as its seq makes a lag longer,
  never shorter). Also the keeper's own µs per applied change under that
  load.

Results are printed as JSON lines and appended to bench/results/keeper.jsonl.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    ROUTES,
    add_json_option,
    keep,
    key_of,
    percentile,
    seed,
    write_json,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _report(doc: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    doc = {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), **doc}
    line = json.dumps(keep(doc))
    print(line, flush=True)
    with open(RESULTS / "keeper.jsonl", "a") as f:
        f.write(line + "\n")


def _seeded(rows: int, now: float) -> Path:
    return seed(RESULTS / f"schedule-{rows}.db", rows, now)


def _copy(src: Path, dst_dir: Path) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / "schedule.db"
    conn = sqlite3.connect(src)
    conn.execute(f"VACUUM INTO '{dst}'")
    conn.close()
    return dst


def bench_feed(args: argparse.Namespace) -> None:
    from keeper.process import Keeper
    from node.core.config import Config
    from node.core.rows import RowWrite
    from node.store import open_store
    from shm.ready import ReadySet
    from shm.state import StateBuffer

    now = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        db = _copy(_seeded(args.rows, now), Path(tmp))
        store = open_store(f"sqlite:///{db}")
        name = f"bench-{uuid.uuid4().hex[:8]}"
        ready = ReadySet.create(name, 5000)
        state = StateBuffer.create(name, started_at=now)
        try:
            keeper = Keeper(Config(name=name, data_dir=Path(tmp)), store, ready, state)
            keeper.start(now)
            while keeper.status == "loading":
                keeper.tick(now)
            rnd = random.Random(7)
            changes = args.changes
            done = 0
            applied_s = 0.0
            applied = 0
            while done < changes:
                batch = []
                for _ in range(5000):
                    i = rnd.randrange(args.rows + args.rows // 10)
                    batch.append(
                        RowWrite(key=key_of(i), route=rnd.choice(ROUTES),
                                 due_at=now + rnd.uniform(-86400, 86400))
                    )
                store.upsert(batch, now=now)
                store.delete([key_of(rnd.randrange(args.rows)) for _ in range(500)])
                done += 5500
                t0 = time.perf_counter()
                applied += keeper.drain_feed(now)
                applied_s += time.perf_counter() - t0
            _report({
                "bench": "feed", "rows": args.rows, "changes": applied,
                "apply_us_per_change": round(applied_s * 1e6 / applied, 3),
            })
        finally:
            ready.close()
            state.close()
            ReadySet.unlink(name)
            StateBuffer.unlink(name)
            store.close()


def _start_node(data_dir: Path, name: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "node", "run", "--data-dir", str(data_dir), "--name", name,
         "--http", "127.0.0.1:0", "--workers", "1", *extra],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(data_dir / "node.log", "ab"),
    )


def _stop_node(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _keeper_uss(pid: int) -> int | None:
    """The keeper's private memory (USS, psutil) once live: the keeper is
    the node's child titled ``qn-keeper`` (node/core/proc.py's set_title)."""
    import psutil

    try:
        for child in psutil.Process(pid).children(recursive=True):
            if "keeper" in child.name():
                return int(child.memory_full_info().uss)
    except psutil.Error:
        return None
    return None


def bench_startup(args: argparse.Namespace) -> None:
    from node.core.errors import NodeError
    from shm.state import StateBuffer

    now = time.time()
    src = _seeded(args.rows, now)
    # Every module's bytecode written first, as an installed package has it:
    # a shell with PYTHONDONTWRITEBYTECODE set (this project's CI has) would
    # otherwise compile each module in each process at every start (~0.1 s).
    for package in ("node", "keeper", "shm", "workers"):
        compileall.compile_dir(ROOT / package, quiet=1)
    for attempt in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp)
            _copy(src, data)
            name = f"bench-{uuid.uuid4().hex[:8]}"
            t_exec = time.time()
            proc = _start_node(data, name)
            state = None
            first_publish = live_exact = None
            deadline = time.monotonic() + 120
            try:
                while time.monotonic() < deadline:
                    if state is None:
                        try:
                            state = StateBuffer.attach(name)
                        except NodeError:
                            time.sleep(0.001)  # polling the segment's appearance
                            continue
                    doc = state.read()
                    if first_publish is None and doc["first_publish_at"]:
                        first_publish = doc["first_publish_at"] - t_exec
                    if doc["status"] == "live" and doc["exact"]:
                        live_exact = time.time() - t_exec
                        break
                    state.wait_status_change(state.status_gen, 0.05)
                if first_publish is None and state is not None:
                    fp = state.read()["first_publish_at"]
                    first_publish = fp - t_exec if fp else None
                keeper_uss = _keeper_uss(proc.pid)
            finally:
                if state is not None:
                    state.close()
                _stop_node(proc)
            _report({
                "bench": "startup", "rows": args.rows, "attempt": attempt,
                "first_publish_s": round(first_publish, 3) if first_publish else None,
                "live_exact_s": round(live_exact, 3) if live_exact else None,
                "keeper_uss_bytes": keeper_uss,
            })


def bench_load(args: argparse.Namespace) -> None:
    """The keeper's load in process: a Keeper over a copy of the seeded file
    with a real ready set and state buffer, ticked until live and once more
    (the first publish of the complete picture). Reports the wall and CPU
    time of it all, the ticks, the longest tick and the p90 (the keeper's
    pauses while it loads: a tick walks one LOAD_CHUNK) and the longest
    publish (the first publish during a load merges what the load left
    pending). No other process runs beside it, so on a shared machine the
    CPU time is the steadier figure."""
    from keeper.process import Keeper
    from node.core.config import Config
    from node.store import open_store
    from shm.ready import ReadySet
    from shm.state import StateBuffer

    src = _seeded(args.rows, time.time())
    for attempt in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            store = open_store(f"sqlite:///{_copy(src, Path(tmp))}")
            name = f"bl{uuid.uuid4().hex[:8]}"
            ready = ReadySet.create(name, 5000)
            state = StateBuffer.create(name, started_at=time.time())
            try:
                keeper = Keeper(Config(name=name, workers=1), store, ready, state)
                t0, cpu0 = time.perf_counter(), time.process_time()
                keeper.start(time.time())
                ticks = []
                while True:
                    live = keeper.status == "live"
                    t = time.perf_counter()
                    keeper.tick(time.time())
                    ticks.append(time.perf_counter() - t)
                    if live:
                        break
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            finally:
                for seg in (ready, state):
                    seg.close()
                ReadySet.unlink(name)
                StateBuffer.unlink(name)
                store.close()
            ticks.sort()
            _report({
                "bench": "load", "rows": args.rows, "attempt": attempt,
                "live_s": round(wall, 3), "cpu_s": round(cpu, 3), "ticks": len(ticks),
                "tick_max_ms": round(ticks[-1] * 1000, 1),
                "tick_p90_ms": round(ticks[len(ticks) * 9 // 10] * 1000, 1),
                "publish_max_ms": keeper.stats.publish["max_ms"],
            })


def _lag_probe(db: Path, name: str, args: argparse.Namespace, now: float,
               stop: threading.Event, lags: list[float]) -> None:
    """One row every ``args.probe_ms`` written as the node's HTTP worker
    writes it (``Store.upsert``, then the keeper's wake), timed from the
    commit returning until the state buffer's ``applied_seq`` reaches its
    change's seq (read after the commit: ``max(seq)``, its own or a later
    one's, so never too short)."""
    from node.core.rows import RowWrite
    from node.store import open_store
    from shm.state import StateBuffer
    from shm.wake import Wake

    store = open_store(f"sqlite:///{db}", node_name=name)
    reader = sqlite3.connect(db, timeout=10)
    state = StateBuffer.attach(name)
    wake = Wake.attach(name)
    rnd = random.Random(11)
    interval = args.probe_ms / 1000
    try:
        while not stop.is_set():
            key = key_of(rnd.randrange(args.rows))
            write = RowWrite(key=key, route=rnd.choice(ROUTES),
                             due_at=now + rnd.uniform(-86400, 86400))
            store.upsert([write], now=time.time())
            committed = time.perf_counter()
            wake.post()
            seq = reader.execute("SELECT max(seq) FROM changes").fetchone()[0]
            deadline = committed + 5
            while state.applied_seq < seq and time.perf_counter() < deadline:
                time.sleep(0.00005)  # polling the keeper's applied_seq
            # (Not applied within 5 s: counted as 5 s, so the tail shows it.)
            lags.append(time.perf_counter() - committed)
            stop.wait(interval)
    finally:
        wake.close()
        state.close()
        reader.close()
        store.close()


def _lag_figures(lags: list[float]) -> dict | None:
    if not lags:
        return None
    ordered = sorted(lags)

    def ms(q: float) -> float:
        value = percentile(ordered, q)
        assert value is not None  # (not empty)
        return round(value * 1000, 3)

    return {"samples": len(ordered), "p50_ms": ms(0.50), "p90_ms": ms(0.90),
            "p99_ms": ms(0.99), "max_ms": ms(1.0)}


def bench_lag(args: argparse.Namespace) -> None:
    from keeper.ask import ask
    from node.core.errors import NodeError
    from shm.state import StateBuffer

    now = time.time()
    src = _seeded(args.rows, now)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        db = _copy(src, data)
        name = f"bench-{uuid.uuid4().hex[:8]}"
        proc = _start_node(data, name)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    info = json.loads((data / "node.json").read_text())
                    state = StateBuffer.attach(name)
                    break
                except (FileNotFoundError, json.JSONDecodeError, NodeError):
                    if time.monotonic() > deadline:
                        raise SystemExit("node did not start") from None
                    time.sleep(0.01)  # polling the node's appearance
            while not (state.read()["status"] == "live" and state.read()["exact"]):
                state.wait_status_change(state.status_gen, 0.1)
            state.close()
            url = f"http://{info['http']}/rows"
            stop = threading.Event()
            sent = {"node": 0, "outside": 0}

            def outside_writer() -> None:
                conn = sqlite3.connect(db, timeout=10)
                rnd = random.Random(3)
                while not stop.is_set():
                    with conn:
                        due = now + rnd.uniform(-3600, 3600)
                        key = key_of(rnd.randrange(args.rows))
                        conn.execute("UPDATE schedule SET due_at = ? WHERE key = ?", (due, key))
                    sent["outside"] += 1
                    stop.wait(0.01)
                conn.close()

            probe_lags: list[float] = []
            probe = threading.Thread(
                target=_lag_probe, args=(db, name, args, now, stop, probe_lags)
            )
            t = threading.Thread(target=outside_writer)
            t.start()
            probe.start()
            rnd = random.Random(5)
            per_request = 100
            interval = per_request / args.rate
            t_end = time.monotonic() + args.seconds
            next_at = time.monotonic()
            while time.monotonic() < t_end:
                body = json.dumps([
                    {"key": key_of(rnd.randrange(args.rows)), "route": rnd.choice(ROUTES),
                     "due_at": now + rnd.uniform(-86400, 86400)}
                    for _ in range(per_request)
                ]).encode()
                req = urllib.request.Request(url, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    resp.read()
                sent["node"] += per_request
                next_at += interval
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # pacing the producer to the target rate
            stop.set()
            t.join()
            probe.join()
            elapsed = args.seconds
            stats = None
            for _ in range(50):
                stats = ask(name, {"op": "stats"}, timeout_s=2)
                if stats:
                    break
            _report({
                "bench": "lag", "rows": args.rows, "target_rate": args.rate,
                "achieved_rate": round(sent["node"] / elapsed), "outside_writes": sent["outside"],
                "lag": stats["lag"] if stats else None,
                "from_commit": _lag_figures(probe_lags),
            })
        finally:
            _stop_node(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["feed", "startup", "load", "lag"])
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--changes", type=int, default=110_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rate", type=int, default=15_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--probe-ms", type=float, default=5.0,
                        help="lag: the commit-to-applied probe's interval between writes")
    add_json_option(parser)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    benches = {"feed": bench_feed, "startup": bench_startup, "load": bench_load, "lag": bench_lag}
    benches[args.what](args)
    write_json(args.json)


if __name__ == "__main__":
    main()
