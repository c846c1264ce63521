"""The node's claim path against peer queues, in one run.

    .venv/bin/python bench/bench_claims.py --rows 250000 --batch 1 64 --procs 2 --seconds 10

Workload (the same as ``bench/claims_external.py``): ``rows`` rows, keys of
about 55 characters, a small JSON payload, due times spread evenly over the
past 30 days (every row is due), 60 s leases, ``procs`` claimer processes
looping claim(batch) and timing every call.

The node runs for real (``python -m node run``, fresh data directory, the
SQLite file copied from a template seeded once and kept in
``bench/results/``), once per path and batch so that every measurement starts
from 250,000 unleased rows:

- ``node_local``: ``node.client.LocalClaimer`` in each claimer process: claims
  straight from shared memory (the path inference processes use).
- ``node_http``: ``node.client.Client.claim`` over HTTP (keep-alive), served
  by ``--workers`` HTTP workers.

Then, in the same run, the peers from ``bench/claims_external.py``
(PostgreSQL SKIP LOCKED in its best index layout, PGQueuer, Redis + Lua; they
need PostgreSQL and Redis, see bench/README.md; ``--no-external`` skips them),
and the ratios against the targets.

Stop rule: a node claimer stops at the deadline, or once it has found nothing
to claim for ``DRAINED_S`` (all rows leased). An empty claim is not the end
here, as it is for the peers: the ready set is a window of ``ready_size``
keys that claimers can empty faster than the keeper republishes, and a claimer
that finds it empty waits for the next publish (LocalClaimer) or retries
after ``HTTP_EMPTY_WAIT_S`` (HTTP); that waiting is inside the measured
window, so it costs grants/s. Latency percentiles are over non-empty claims,
as for the peers.

Each node result also says where the machine's CPU went while claiming
(``cpu_s``): the claimers' own ``process_time`` over their loops, and the
node's processes by title (``keeper``, ``ledger``, ``worker-N``) from psutil,
from the claimers' start to the last one's report (so it includes the
``DRAINED_S`` wait at the end). Divided by ``grants`` it is the CPU a grant
costs in each process, which noise on a shared machine moves less than the
rate. ``claimer_page_faults`` is the claimers' minor page faults over their
loops (``getrusage``); ``claimer_waited_s`` the time they spent waiting for a
set that a later grant ended (the wait after the last grant is not counted).

With ``--rounds N`` the whole sequence runs N times, one round after
another, and the ratios compare each variant's median round (the range of
its rounds beside it): a run of the node or of Redis at batch 64 lasts about
a second, so one burst of another job on the machine moves a single round by
a third.

Every result is one JSON line, appended to ``bench/results/claims.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_mod
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import uuid
from array import array
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.claims_external import (  # noqa: E402 - after the path fix above
    LEASE_S,
    RESULTS,
    RUNNERS,
    _percentile,
    due_of,
    key_of,
)
from bench.common import (  # noqa: E402 - after the path fix
    add_json_option,
    finish_template,
    keep,
    reusable,
    write_json,
)

# A claimer that found nothing for this long decides every row is leased.
DRAINED_S = 2.0
# An HTTP claimer that got nothing tries again after this (no long poll on /claim).
HTTP_EMPTY_WAIT_S = 0.002
START_DELAY_S = 0.3
NODE_START_S = 180.0
# Room for every row to be leased at once (the default 65,536 is sized for
# live leases, not for a bench that leases a whole table within a minute).
LEASE_CAPACITY = 1 << 19

# Targets (the issue): the node's grants/s over the best peer, per batch.
TARGETS = {1: {"postgres": 20.0, "redis": 5.0}, 64: {"postgres": 5.0, "redis": 1.5}}


# -- the schedule file ---------------------------------------------------------------


def template(
    rows: int, results: Path = RESULTS, name: str = "claims", job: str = "",
    scattered: bool = False,
) -> Path:  # fmt: skip
    """A SQLite schedule with ``rows`` due rows, made once and reused
    (``results/<name>-<rows>.db``): keys of about 55 characters, 20 routes, the
    due times spread (in key order, or ``scattered``: see ``due_of``); job
    ``job``, or one of seven when it is empty."""
    path = results / f"{name}{'-scattered' if scattered else ''}-{rows}.db"
    if reusable(path, rows):
        return path
    from node.core.rows import RowWrite
    from node.store import open_store

    results.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    now = time.time()
    store = open_store(f"sqlite:///{path}")
    for lo in range(0, rows, 10_000):
        batch = [
            RowWrite(
                key=key_of(i),
                route=f"route{i % 20:02d}",
                due_at=due_of(i, rows, now, scattered),
                payload={"route": f"route{i % 20:02d}", "n": i},
                job=job or f"job-{i % 7}",
            )
            for i in range(lo, min(rows, lo + 10_000))
        ]
        store.upsert(batch, now=now)
    return finish_template(store, path, rows, t0)


# -- a node ----------------------------------------------------------------------------


class Node:
    """``python -m node run`` on a fresh copy of the template."""

    def __init__(self, db: Path, workers: int, ready_size: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="qn-bench-"))
        self.name = f"bench-{uuid.uuid4().hex[:8]}"
        shutil.copyfile(db, self.dir / "schedule.db")
        env = dict(os.environ, QUEUE_NODE_LEASE_CAPACITY=str(LEASE_CAPACITY))
        argv = [
            sys.executable, "-m", "node", "run",
            "--data-dir", str(self.dir),
            "--name", self.name,
            "--http", "127.0.0.1:0",
            "--workers", str(workers),
            "--ready-size", str(ready_size),
        ]  # fmt: skip
        self.log = open(self.dir / "node.log", "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=self.log)
        self.http = self._wait_started()

    def _wait_started(self) -> str:
        from shm.state import read_state

        deadline = time.monotonic() + NODE_START_S
        http = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited {self.proc.returncode}: see {self.dir}/node.log")
            if http is None:
                try:
                    http = json.loads((self.dir / "node.json").read_text())["http"]
                except (OSError, ValueError, KeyError):
                    pass
            else:
                try:
                    state = read_state(self.name)
                    with urllib.request.urlopen(f"http://{http}/readyz", timeout=2) as resp:
                        ready = resp.status == 200
                except Exception:  # noqa: BLE001 - not up yet
                    state, ready = None, False
                # Loaded and caught up, and a set published since.
                if ready and state and state["trust"]["exact"]:
                    return http
            time.sleep(0.05)  # a polling interval while the node loads
        raise RuntimeError(f"node not ready after {NODE_START_S} s: see {self.dir}/node.log")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- claimers --------------------------------------------------------------------------


def _loop(claim, wait_empty, start_at: float, seconds: float) -> dict:
    lat = array("d")
    grants = claims = empty = 0
    now = time.monotonic()
    if start_at > now:
        time.sleep(start_at - now)
    deadline = start_at + seconds
    t = last_grant = time.monotonic()
    cpu0 = time.process_time()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    drained = False
    waited = waiting = 0.0  # waits for a set: before a later grant / since the last
    while t < deadline:
        n = claim()
        t2 = time.monotonic()
        claims += 1
        if n:
            lat.append(t2 - t)
            grants += n
            last_grant = t2
            waited += waiting
            waiting = 0.0
        else:
            empty += 1
            if t2 - last_grant > DRAINED_S:
                drained = True
                break
            wait_empty()
            t3 = time.monotonic()
            waiting += t3 - t2
            t2 = t3
        t = t2
    stopped = (last_grant if drained else t) - start_at
    return {
        "cpu_s": time.process_time() - cpu0,
        "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0,
        "grants": grants,
        "claims": claims,
        "empty": empty,
        "waited_s": waited,
        "drained": drained,
        "stopped_at": stopped,
        "last_grant_at": last_grant - start_at,
        "lat": lat.tobytes(),
    }


def _local_claimer(cfg: dict, idx: int, batch: int, seconds: float) -> Any:
    from node.client import LocalClaimer

    local = LocalClaimer(cfg["name"], data_dir=cfg["dir"], consumer=f"bench-{idx}")
    claimer = local.claimer
    generation = [claimer.generation]

    def claim() -> int:
        generation[0] = claimer.generation
        return len(claimer.claim(batch, LEASE_S, local.consumer, time.time()))

    def wait_empty() -> None:
        claimer.wait_for_publish(generation[0], 0.05)

    return local, claim, wait_empty


def _http_claimer(cfg: dict, idx: int, batch: int, seconds: float) -> Any:
    from node.client import Client

    client = Client(f"http://{cfg['http']}")
    consumer = f"bench-{idx}"
    client.request("GET", "/healthz")  # connect before the clock starts

    def claim() -> int:
        return len(client.claim(batch, LEASE_S, consumer))

    def wait_empty() -> None:
        time.sleep(HTTP_EMPTY_WAIT_S)

    return client, claim, wait_empty


CLAIMERS = {"node_local": _local_claimer, "node_http": _http_claimer}


def _child(kind, cfg, idx, batch, seconds, ready, go, start, out) -> None:
    try:
        handle, claim, wait_empty = CLAIMERS[kind](cfg, idx, batch, seconds)
        from node.core.proc import set_title

        set_title(f"qn-claimer-{idx}")  # for a profiler: `perf report --comm qn-claimer-0`
        ready.put(idx)
        go.wait()
        res = _loop(claim, wait_empty, start.value, seconds)
        handle.close()
        out.put((idx, res, None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((idx, None, traceback.format_exc()))
        ready.put(idx)


def measure(
    kind: str,
    cfg: dict,
    batch: int,
    procs: int,
    seconds: float,
    node_pid: int | None = None,
    pg: tuple[str, str] | None = None,
) -> dict:
    """``procs`` claimers of ``kind`` for ``seconds``: grants, latencies and
    the CPU each process spent meanwhile (the node's by process title; with
    ``pg``, a node's PostgreSQL (dsn, database), the server's backends
    connected to that database as ``postgres``)."""
    load_1m = os.getloadavg()[0]
    node_cpu = _NodeCPU(node_pid)
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    start = ctx.Value("d", 0.0)
    children = [
        ctx.Process(target=_child, args=(kind, cfg, i, batch, seconds, ready, go, start, out))
        for i in range(procs)
    ]
    for p in children:
        p.start()
    try:
        for _ in children:
            ready.get(timeout=120)
        # The backends connected once the claimers are (a node's pools are by now).
        server_cpu = pg_backends_cpu(*pg) if pg is not None else _NodeCPU(None)
        start.value = time.monotonic() + START_DELAY_S
        go.set()
        node_cpu.mark(start.value)
        server_cpu.mark(start.value)
        results, errors = [], []
        while len(results) + len(errors) < procs:
            try:
                _idx, res, err = out.get(timeout=seconds + 120)
            except queue_mod.Empty:
                raise RuntimeError(f"{kind}: claimers did not report in time") from None
            (errors.append(err) if err else results.append(res))
        node_cpu.stop()
        server_cpu.stop()
        if errors:
            raise RuntimeError(f"{kind}: a claimer failed:\n" + "\n".join(errors))
    finally:
        for p in children:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    lat: list[float] = []
    for r in results:
        a = array("d")
        a.frombytes(r["lat"])
        lat.extend(a)
    lat.sort()
    grants = sum(r["grants"] for r in results)
    window = max(r["stopped_at"] for r in results)
    p50, p99 = _percentile(lat, 0.5), _percentile(lat, 0.99)
    return {
        "variant": kind,
        "batch": batch,
        "procs": procs,
        "grants": grants,
        "seconds": round(window, 3),
        "grants_per_s": round(grants / window, 1) if window > 0 else 0.0,
        "p50_ms": round(p50 * 1e3, 3) if p50 is not None else None,
        "p99_ms": round(p99 * 1e3, 3) if p99 is not None else None,
        "claims": sum(r["claims"] for r in results),
        "empty_claims": sum(r["empty"] for r in results),
        "claimer_page_faults": sum(r["faults"] for r in results),
        "claimer_waited_s": round(sum(r["waited_s"] for r in results), 3),
        "drained": any(r["drained"] for r in results),
        # When the last claimer granted its last lease (a run that ran out of
        # rows is timed to it by a caller that knows how many there were).
        "last_grant_s": round(max((r.get("last_grant_at", 0.0) for r in results), default=0.0), 3),
        "cpus": os.cpu_count(),
        "loadavg_1m": round(load_1m, 2),
        # CPU seconds spent while claiming: where the machine's time went.
        "cpu_s": {
            "claimers": round(sum(r["cpu_s"] for r in results), 3),
            **node_cpu.spent(),
            **server_cpu.spent(),
        },
    }


class _NodeCPU:
    """CPU seconds of the node's processes (keeper, HTTP workers, ledger)
    from the claimers' start to the last claimer's report, by process title."""

    def __init__(self, pid: int | None) -> None:
        self.procs: list[Any] = []
        self.before: dict[int, float] = {}
        self.after: dict[int, float] = {}
        if pid is None:
            return
        import psutil

        try:
            self.procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            self.procs = []

    def _read(self) -> dict[int, float]:
        out = {}
        for p in self.procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except Exception:  # noqa: BLE001 - a process that went away
                pass
        return out

    def mark(self, at: float) -> None:
        wait = at - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # read at the claimers' start, not before
        self.before = self._read()

    def stop(self) -> None:
        self.after = self._read()

    def spent(self) -> dict[str, float]:
        by: dict[str, float] = {}
        for p in self.procs:
            if p.pid in self.before and p.pid in self.after:
                try:
                    name = p.name()
                except Exception:  # noqa: BLE001
                    name = str(p.pid)
                name = name.removeprefix("qn-")
                by[name] = round(by.get(name, 0.0) + self.after[p.pid] - self.before[p.pid], 3)
        return by


def pg_backends_cpu(dsn: str, db: str) -> _NodeCPU:
    """A CPU reader (``mark``, ``stop``, ``spent``) of the PostgreSQL backends
    connected to database ``db``, reported as ``postgres``: a peer's
    claimers' and receiver's connections, or a node's pools. A backend that
    connects during the window (a pool growing under load) is counted from
    zero at ``stop``: all its CPU was spent in the window. The server's shared
    processes (the WAL writer among them) are not counted: other databases of
    the server use them too."""
    import psutil
    import psycopg

    def backends() -> dict[int, Any]:
        found = {}
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                pids = [pid for (pid,) in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = %s"
                    " AND pid <> pg_backend_pid()",
                    (db,),
                ).fetchall()]  # fmt: skip
        except Exception:  # noqa: BLE001 - not counted then (another user's server)
            return found
        for pid in pids:
            try:
                found[pid] = psutil.Process(pid)
            except psutil.Error:  # gone between the query and here
                pass
        return found

    class Backends(_NodeCPU):
        def stop(self) -> None:
            known = {p.pid for p in self.procs}
            for pid, proc in backends().items():
                if pid not in known:
                    self.procs.append(proc)
                    self.before[pid] = 0.0  # connected within the window
            super().stop()

        def spent(self) -> dict[str, float]:
            return {"postgres": round(sum(super().spent().values()), 3)}

    cpu = Backends(None)
    cpu.procs = list(backends().values())
    return cpu


def run_node(
    kind: str, db: Path, rows: int, batch: int, procs: int, seconds: float, args: Any
) -> dict:
    node = Node(db, workers=args.workers, ready_size=args.ready_size)
    try:
        cfg = {"name": node.name, "dir": str(node.dir), "http": node.http}
        res = measure(kind, cfg, batch, procs, seconds, node_pid=node.proc.pid)
        res.update(rows=rows, ready_size=args.ready_size, workers=args.workers)
        res["keeper_publish"] = keeper_publish(node.name)
        return res
    finally:
        node.stop()


def keeper_publish(name: str) -> dict | None:
    """The keeper's publish figures (count, last_ms, max_ms) from its next
    state write after the run: how long a republish took with the leases out."""
    from shm.state import read_state

    after = time.time()
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline:
        state = read_state(name)
        if (state["trust"].get("state_age_s") or 1e9) < time.time() - after:
            return state["trust"].get("publish")
        time.sleep(0.2)  # the keeper writes its state every 5 s
    return None


# -- report ----------------------------------------------------------------------------


def report(doc: dict[str, Any], name: str = "claims.jsonl") -> None:
    """Print one result and append it to ``bench/results/<name>``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    line = json.dumps(keep({"at": time.strftime("%Y-%m-%dT%H:%M:%S"), **doc}))
    print(line, flush=True)
    with open(RESULTS / name, "a") as f:
        f.write(line + "\n")


def _median_runs(runs: list[dict]) -> dict:
    """One variant's runs as one: the run of median grants/s (the lower
    middle of an even count), with the range of all of them."""
    runs = sorted(runs, key=lambda r: r["grants_per_s"])
    mid = dict(runs[(len(runs) - 1) // 2])
    mid["range"] = (runs[0]["grants_per_s"], runs[-1]["grants_per_s"])
    mid["runs"] = len(runs)
    return mid


def ratios(results: list[dict]) -> None:
    """The node's grants/s over the best PostgreSQL variant and over Redis, per
    batch; with several rounds, each variant's median round."""
    print("\nbatch  path        grants/s   p50 ms  p99 ms   x best PG (target)   x Redis (target)")
    for batch, target in TARGETS.items():
        by_variant: dict[str, list[dict]] = {}
        for r in results:
            if r["batch"] == batch:
                by_variant.setdefault(r["variant"], []).append(r)
        same = [_median_runs(runs) for runs in by_variant.values()]
        pg = [r for r in same if r["variant"] in ("postgres_skip_locked", "pgqueuer")]
        redis = [r for r in same if r["variant"] == "redis_lua"]
        best_pg = max((r["grants_per_s"] for r in pg), default=None)
        best_redis = max((r["grants_per_s"] for r in redis), default=None)
        for r in same:
            if not r["variant"].startswith("node_"):
                continue
            x_pg = r["grants_per_s"] / best_pg if best_pg else None
            x_redis = r["grants_per_s"] / best_redis if best_redis else None

            def fmt(x: float | None, want: float) -> str:
                if x is None:
                    return "      n/a      "
                mark = "ok" if x >= want else "MISS"
                return f"{x:6.2f} ({want:>4} {mark:>4})"

            print(
                f"{batch:>5}  {r['variant']:<10} {r['grants_per_s']:>10.0f} "
                f"{r['p50_ms']!s:>8} {r['p99_ms']!s:>7}   {fmt(x_pg, target['postgres'])}"
                f"   {fmt(x_redis, target['redis'])}{_spread(r)}"
            )
        for r in same:
            if not r["variant"].startswith("node_"):
                print(f"{batch:>5}  {r['variant']:<20} {r['grants_per_s']:>10.0f} "
                      f"{r['p50_ms']!s:>8} {r['p99_ms']!s:>7}{_spread(r)}")  # fmt: skip


def _spread(r: dict) -> str:
    if r["runs"] < 2:
        return ""
    lo, hi = r["range"]
    return f"   ({r['runs']} rounds: {lo:.0f}-{hi:.0f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/bench_claims.py", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=250_000)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--paths", nargs="+", default=["node_local", "node_http"], choices=CLAIMERS)
    p.add_argument("--workers", type=int, default=2, help="the node's HTTP workers")
    p.add_argument("--ready-size", type=int, default=5000)
    p.add_argument("--no-external", action="store_true", help="skip PostgreSQL and Redis")
    p.add_argument(
        "--external",
        nargs="+",
        default=["postgres_skip_locked", "pgqueuer", "redis_lua"],
        help="peer variants to run (bench/claims_external.py)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run everything this many times, rounds one after another; the "
        "ratios compare each variant's median round",
    )
    add_json_option(p)
    args = p.parse_args(argv)
    db = template(args.rows)
    results = []
    for _round in range(args.rounds):
        for batch in args.batch:
            for kind in args.paths:
                res = run_node(kind, db, args.rows, batch, args.procs, args.seconds, args)
                report(res)
                results.append(res)
        if not args.no_external:
            for batch in args.batch:
                for variant in args.external:
                    try:
                        res = RUNNERS[variant](args.rows, batch, args.procs, args.seconds)
                    except Exception as exc:  # noqa: BLE001 - a missing server skips its peer
                        print(f"{variant} batch {batch}: skipped: {exc!r}", file=sys.stderr)
                        why = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:200]
                        keep({"variant": variant, "batch": batch, "not_run": why})
                        continue
                    res.pop("tried", None)
                    report(res)
                    results.append(res)
    ratios(results)
    write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
