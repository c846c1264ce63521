"""The production-size churned run (issue 16, item 5).

    .venv/bin/python bench/bench_churn.py                           # 1,000,000 rows, 10 min
    .venv/bin/python bench/bench_churn.py --rows 100000 --minutes 1 # a quick try

A node (``python -m node run``, ``node.testing.NodeProcess``) on ``rows`` rows
of job ``j`` (keys of about 55 characters, 20 routes, a cadence of 60-120 s,
due times spread over the 30 days before the template was seeded, so all are
due at the start) is churned for ``--minutes``:

- ``--procs`` claimer processes loop ``LocalClaimer.claim(64)`` then
  ``complete_many`` of the batch with a 200-byte result; every completion
  writes the row's next due time back (finished + cadence, 60-120 s), so once
  the backlog is worked off the rows come due again during the run;
- one producer process writes ``--write-rate`` rows/s through ``POST /rows``
  (100 rows a request): updates of existing keys, same route, a new due time
  within the next two minutes;
- one receiver process polls ``GET /jobs/j/results`` (up to 1,000) and acks.

Every ``--sample-s`` the parent records completions/s, acks/s, producer
writes/s, the keeper's USS (psutil, the node's child titled ``qn-keeper``) and
the keeper's own commit → applied lag figures (``ask(name, {"op": "stats"})``,
keeper/lag.py: p50/p99/max over the last one to two minutes of applied
changes). After the window the load stops, the keeper catches up, and the
keeper alone is killed with SIGKILL (the supervisor restarts it). From the
kill, as seen from outside (``GET /readyz`` and ``GET /queue-state`` polled
every ``POLL_S``): the first ``/readyz`` 200 of the new keeper (its first
publish), ``trust.status`` live, and live with ``trust.exact`` (vouched); the
state buffer's ``first_publish_at`` stamp of the new keeper beside them. The
same kill is then measured on a fresh copy of the template with no churn.

Prints a table; ``--json PATH`` writes the figures (name, value, unit, setup,
machine) and the timeline; each run is also appended to
bench/results/churn.jsonl.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.claims_external import RESULTS, due_of, key_of  # noqa: E402 - after the path fix
from bench.common import finish_template, reusable  # noqa: E402 - after the path fix

JOB = "j"
BATCH = 64
LEASE_S = 60.0
RESULT = bytes(range(200))
CADENCE_MIN_S, CADENCE_SPAN_S = 60, 61  # cadence 60..120 s
PER_REQUEST = 100  # rows a POST /rows
POLL_S = 0.01  # the outside poll after the kill
KILL_DEADLINE_S = 600.0
LEASE_CAPACITY = 1 << 19


def cadence_of(i: int) -> int:
    return CADENCE_MIN_S + i % CADENCE_SPAN_S


def route_of(i: int) -> str:
    return f"route{i % 20:02d}"


def template(rows: int, results: Path = RESULTS) -> Path:
    """``results/churn-<rows>.db``, seeded once and reused."""
    path = results / f"churn-{rows}.db"
    if reusable(path, rows):
        return path
    from node.core.rows import RowWrite
    from node.store import open_store

    results.mkdir(parents=True, exist_ok=True)
    t0, now = time.perf_counter(), time.time()
    store = open_store(f"sqlite:///{path}")
    for lo in range(0, rows, 10_000):
        store.upsert(
            [
                RowWrite(
                    key=key_of(i),
                    route=route_of(i),
                    cadence_s=cadence_of(i),
                    due_at=due_of(i, rows, now),
                    payload={"n": i},
                    job=JOB,
                )  # fmt: skip
                for i in range(lo, min(rows, lo + 10_000))
            ],
            now=now,
        )
    return finish_template(store, path, rows, t0)


# -- the load (child processes) ----------------------------------------------------------------


def _claimer(name: str, data_dir: str, idx: int, stop: Any, done: Any, refused: Any, out: Any):
    try:
        from node.client import ClientError, LocalClaimer

        local = LocalClaimer(name, data_dir=data_dir, consumer=f"churn-{idx}")
        lat = []
        while not stop.is_set():
            t = time.monotonic()
            grants = local.claim(BATCH, LEASE_S, wait_s=0.05)
            if not grants:
                continue
            try:
                answers = local.complete_many([(g.lease_id, g.key, RESULT) for g in grants])
            except ClientError:
                refused.value += len(grants)
                continue
            ok = sum(1 for a in answers if type(a) is int)
            done.value += ok
            refused.value += len(grants) - ok
            lat.append(time.monotonic() - t)
        local.close()
        out.put(("claimer", idx, sorted(lat), None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("claimer", idx, None, traceback.format_exc()))


def _producer(http: str, rows: int, rate: float, stop: Any, sent: Any, out: Any) -> None:
    try:
        from node.client import Client

        client = Client(f"http://{http}")
        rnd = random.Random(7)
        interval = PER_REQUEST / rate
        next_at = time.monotonic()
        lat = []
        while not stop.is_set():
            now = time.time()
            body = []
            for _ in range(PER_REQUEST):
                i = rnd.randrange(rows)
                body.append({"key": key_of(i), "route": route_of(i),
                             "due_at": now + rnd.uniform(0, 120)})  # fmt: skip
            t = time.monotonic()
            client.request("POST", "/rows", body)
            lat.append(time.monotonic() - t)
            sent.value += PER_REQUEST
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                stop.wait(delay)  # pacing the producer to its rate
            else:
                next_at = time.monotonic()  # behind: no burst to catch up
        client.close()
        out.put(("producer", 0, sorted(lat), None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("producer", 0, None, traceback.format_exc()))


def _receiver(http: str, stop: Any, acked: Any, out: Any) -> None:
    try:
        from node.client import Client

        client = Client(f"http://{http}")
        while not stop.is_set():
            results = client.poll(JOB, max=1000, wait_s=0.2)
            if results:
                client.ack(JOB, [r["id"] for r in results])
                acked.value += len(results)
        client.close()
        out.put(("receiver", 0, [], None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("receiver", 0, None, traceback.format_exc()))


# -- the node ------------------------------------------------------------------------------------


def _start(db: Path | None, workers: int) -> Any:
    from node.testing import NodeProcess

    data = Path(tempfile.mkdtemp(prefix="qn-churn-"))
    if db is not None:
        shutil.copyfile(db, data / "schedule.db")
    node = NodeProcess(data, f"churn-{uuid.uuid4().hex[:8]}", "--ready-size", "5000",
                       env={"QUEUE_NODE_LEASE_CAPACITY": str(LEASE_CAPACITY)},
                       workers=workers, test_hooks=False)  # fmt: skip
    node.start(wait_ready=False, timeout_s=120)
    _wait_exact(node, 900)
    return node


def _finish(node: Any) -> None:
    from node.testing import cleanup_segments

    try:
        node.stop(timeout_s=120)
    except AssertionError:
        pass
    cleanup_segments(node.name)
    shutil.rmtree(node.data_dir, ignore_errors=True)


def _get(node: Any, path: str) -> tuple[int, Any]:
    try:
        return node.request("GET", path, timeout_s=2)
    except (OSError, urllib.error.URLError):
        return 0, None


def _wait_exact(node: Any, timeout_s: float) -> float:
    """Polls ``GET /queue-state`` until the keeper vouches (live or verifying,
    exact): the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        node.check_alive()
        status, doc = _get(node, "/queue-state")
        if status == 200 and doc["trust"].get("exact"):
            return time.monotonic() - t0
        time.sleep(0.05)  # polling interval of a deadline wait
    raise RuntimeError(f"the keeper did not vouch within {timeout_s} s: {node.log()}")


def _keeper(node: Any) -> Any:
    import psutil

    for child in psutil.Process(node.proc.pid).children(recursive=True):
        try:
            if "keeper" in child.name():
                return child
        except psutil.Error:
            continue
    return None


def _uss(proc: Any) -> int | None:
    try:
        return int(proc.memory_full_info().uss)
    except Exception:  # noqa: BLE001 - gone
        return None


def _lag(node: Any) -> dict | None:
    from keeper.ask import ask

    try:
        stats = ask(node.name, {"op": "stats"}, timeout_s=2)
    except Exception:  # noqa: BLE001 - a busy keeper: no sample this time
        return None
    return (stats or {}).get("lag")


def kill_keeper(node: Any) -> dict:
    """kill -9 of the keeper alone; its restart as seen from outside the
    keeper: the state buffer's writer pid and publish stamp (what claimers
    see), ``GET /queue-state``'s ``trust`` (status live, then exact)."""
    from shm.state import StateBuffer

    old = _keeper(node)
    assert old is not None, "no keeper process"
    old_pid = old.pid
    seen: dict[str, Any] = {"restarted_s": None, "first_publish_s": None, "live_s": None,
                            "exact_s": None}  # fmt: skip
    buf = StateBuffer.attach(node.name, read_only=True)
    try:
        t_kill = time.time()
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + KILL_DEADLINE_S
        while time.monotonic() < deadline and seen["exact_s"] is None:
            node.check_alive()
            t = round(time.time() - t_kill, 3)
            state = buf.read()
            new = state["writer_pid"] not in (None, 0, old_pid)
            if new and seen["restarted_s"] is None:
                seen["restarted_s"] = t  # the new keeper's first write to the buffer
            if new and seen["first_publish_s"] is None and state["published_at"] > t_kill:
                seen["first_publish_s"] = t
                seen["first_publish_stamp_s"] = round(state["published_at"] - t_kill, 3)
            if new:
                q_status, doc = _get(node, "/queue-state")
                trust = (doc or {}).get("trust") or {}
                if trust.get("live") and trust.get("status") == "live":
                    seen["live_s"] = seen["live_s"] or t
                    if q_status == 200 and trust.get("exact"):
                        seen["exact_s"] = t
            time.sleep(POLL_S)  # the outside poll's interval
    finally:
        buf.close()
    seen["readyz_after"] = _get(node, "/readyz")[0]
    k = _keeper(node)
    seen["keeper_uss_bytes"] = _uss(k) if k is not None else None
    return seen


# -- the run ---------------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float | None:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2) if xs else None


def churn(db: Path, args: argparse.Namespace) -> dict:
    node = _start(db, args.workers)
    try:
        store_mb_before = _store_mb(node.data_dir)
        ctx = mp.get_context("spawn")
        stop, out = ctx.Event(), ctx.Queue()
        done = [ctx.Value("q", 0, lock=False) for _ in range(args.procs)]
        refused = [ctx.Value("q", 0, lock=False) for _ in range(args.procs)]
        sent, acked = ctx.Value("q", 0, lock=False), ctx.Value("q", 0, lock=False)
        http = node.info["http"]
        children = [
            ctx.Process(target=_claimer,
                        args=(node.name, str(node.data_dir), i, stop, done[i], refused[i], out))
            for i in range(args.procs)
        ]  # fmt: skip
        children.append(ctx.Process(target=_receiver, args=(http, stop, acked, out)))
        if args.write_rate > 0:
            children.append(
                ctx.Process(
                    target=_producer, args=(http, args.rows, args.write_rate, stop, sent, out)
                )
            )
        keeper = _keeper(node)
        cpu0 = _cpu(node)
        for p in children:
            p.start()
        timeline: list[dict] = []
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        last = (t0, 0, 0, 0)
        while time.monotonic() < end:
            time.sleep(min(args.sample_s, max(0.0, end - time.monotonic())))  # sampling interval
            node.check_alive()
            t = time.monotonic()
            d, a, w = sum(v.value for v in done), acked.value, sent.value
            dt = t - last[0]
            timeline.append({
                "t_s": round(t - t0, 1),
                "completed_per_s": round((d - last[1]) / dt, 1),
                "acked_per_s": round((a - last[2]) / dt, 1),
                "written_per_s": round((w - last[3]) / dt, 1),
                "keeper_uss_bytes": _uss(keeper),
                "lag": _lag(node),
                "loadavg_1m": round(os.getloadavg()[0], 2),
            })  # fmt: skip
            last = (t, d, a, w)
            s = timeline[-1]
            mib = (s["keeper_uss_bytes"] or 0) / 2**20
            print(f"  t={s['t_s']:>6}s done/s {s['completed_per_s']:>8} acked/s "
                  f"{s['acked_per_s']:>8} writes/s {s['written_per_s']:>7} keeper "
                  f"{mib:.0f} MiB lag {s['lag']}", flush=True)  # fmt: skip
        window = time.monotonic() - t0
        cpu = {k: round(v - cpu0.get(k, 0.0), 1) for k, v in _cpu(node).items()}
        stop.set()
        got: dict[str, list] = {}
        for _ in children:
            role, idx, lat, err = out.get(timeout=120)
            if err:
                raise RuntimeError(f"{role} {idx} failed:\n{err}")
            got.setdefault(role, []).extend(lat)
        for p in children:
            p.join(timeout=30)
        completed, written = sum(v.value for v in done), sent.value
        catch_up_s = _wait_exact(node, 600)
        res: dict[str, Any] = {
            "window_s": round(window, 1),
            "completed": completed,
            "completed_per_s": round(completed / window, 1),
            "refused": sum(v.value for v in refused),
            "acked": acked.value,
            "written": written,
            "written_per_s": round(written / window, 1),
            "cycle_p50_ms": _pct(sorted(got.get("claimer", [])), 0.5),
            "cycle_p99_ms": _pct(sorted(got.get("claimer", [])), 0.99),
            "post_rows_p50_ms": _pct(got.get("producer", []), 0.5),
            "post_rows_p99_ms": _pct(got.get("producer", []), 0.99),
            "cpu_s": cpu,
            "catch_up_s": round(catch_up_s, 2),
            "timeline": timeline,
            "store_mb_before": store_mb_before,
            "store_mb_after": _store_mb(node.data_dir),
            "files_mb_after": _files_mb(node.data_dir),
        }
        res["lag"] = _lag_summary(timeline)
        uss = [s["keeper_uss_bytes"] for s in timeline if s["keeper_uss_bytes"]]
        res["keeper_uss_max_bytes"] = max(uss) if uss else None
        res["keeper_uss_end_bytes"] = uss[-1] if uss else None
        res["kill"] = kill_keeper(node)
        return res
    finally:
        _finish(node)


def _cpu(node: Any) -> dict[str, float]:
    import psutil

    out: dict[str, float] = {}
    for p in [psutil.Process(node.proc.pid), *psutil.Process(node.proc.pid).children(True)]:
        try:
            t = p.cpu_times()
            name = p.name().removeprefix("qn-")
            out[name] = out.get(name, 0.0) + t.user + t.system
        except psutil.Error:
            continue
    return out


def _store_mb(data: Path) -> float:
    return round(sum(f.stat().st_size for f in data.rglob("*") if f.is_file()) / 2**20, 1)


def _files_mb(data: Path) -> dict[str, float]:
    """MiB by top-level entry of the data directory (schedule.db, its WAL, the
    completion log's folder, ...)."""
    out: dict[str, float] = {}
    for f in data.rglob("*"):
        if f.is_file():
            top = f.relative_to(data).parts[0]
            out[top] = out.get(top, 0.0) + f.stat().st_size / 2**20
    return {k: round(v, 1) for k, v in sorted(out.items()) if v >= 0.1}


def _lag_summary(timeline: list[dict]) -> dict:
    """The keeper's lag figures over the run, by origin of the write (``node``:
    through the node, the producer's and the ledger's write-backs); each
    sample covers the last one to two minutes of applied changes."""
    out: dict[str, Any] = {}
    lags = [s["lag"] for s in timeline if s.get("lag")]
    for origin in sorted({k for x in lags for k, v in x.items() if isinstance(v, dict)}):
        figs = [x[origin] for x in lags if isinstance(x.get(origin), dict)]
        p50s = sorted(f["p50_ms"] for f in figs)
        p99s = sorted(f["p99_ms"] for f in figs)
        out[origin] = {
            "samples": len(figs),
            "p50_ms_median": p50s[len(p50s) // 2],
            "p99_ms_median": p99s[len(p99s) // 2],
            "p99_ms_worst": p99s[-1],
            "max_ms": max(f["max_ms"] for f in figs),
        }
    apply_us = sorted(x["apply_us"] for x in lags if isinstance(x.get("apply_us"), int | float))
    if apply_us:
        out["apply_us_median"] = apply_us[len(apply_us) // 2]
    return out


def fresh(db: Path, args: argparse.Namespace) -> dict:
    node = _start(db, args.workers)
    try:
        keeper = _keeper(node)
        res: dict[str, Any] = {
            "keeper_uss_bytes": _uss(keeper),
            "store_mb": _store_mb(node.data_dir),
        }
        res["kill"] = kill_keeper(node)
        return res
    finally:
        _finish(node)


def empty_keeper_uss(args: argparse.Namespace) -> int | None:
    node = _start(None, 1)
    try:
        return _uss(_keeper(node))
    finally:
        _finish(node)


def _table(doc: dict) -> None:
    c, f = doc["churned"], doc["fresh"]
    print(f"\nchurn: {doc['rows']:,} rows, {c['window_s']:.0f} s, {doc['procs']} claimers, "
          f"producer {c['written_per_s']:.0f} rows/s; "
          f"load average {doc['loadavg_1m']} -> {doc['loadavg_end_1m']}")  # fmt: skip
    print(f"  completions/s {c['completed_per_s']:.0f}  acked {c['acked']:,}  refused "
          f"{c['refused']:,}  cycle p50/p99 {c['cycle_p50_ms']}/{c['cycle_p99_ms']} ms  "
          f"POST /rows p50/p99 {c['post_rows_p50_ms']}/{c['post_rows_p99_ms']} ms")  # fmt: skip
    print(f"  commit -> applied lag, the keeper's figures by origin: {c['lag']}")
    base = doc.get("empty_keeper_uss_bytes") or 0
    for what, uss in (("end", c["keeper_uss_end_bytes"]), ("max", c["keeper_uss_max_bytes"])):
        if uss:
            print(
                f"  keeper USS {what}: {uss / 2**20:.1f} MiB, "
                f"{(uss - base) / doc['rows']:.0f} B/row above an empty node's keeper"
            )
    print(f"  store: {c['store_mb_before']} MiB -> {c['store_mb_after']} MiB\n")
    print(
        "kill -9 of the keeper     restarted   first publish   live     exact   (stamp)  USS after"
    )
    for what, r in (("churned store", c["kill"]), ("fresh store", f["kill"])):
        print(f"{what:<24} {r.get('restarted_s')!s:>9} {r['first_publish_s']!s:>15} "
              f"{r['live_s']!s:>7} {r['exact_s']!s:>8} {r.get('first_publish_stamp_s')!s:>8} "
              f"{(r['keeper_uss_bytes'] or 0) / 2**20:>8.1f} MiB")  # fmt: skip


def records(doc: dict) -> list[dict]:
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(),
               "platform": platform.platform(), "loadavg_1m": doc["loadavg_1m"],
               "note": "one run, shared machine"}  # fmt: skip
    setup = {k: doc[k] for k in ("rows", "minutes", "procs", "write_rate", "batch")}
    c = doc["churned"]
    out = []

    def add(name: str, value: Any, unit: str) -> None:
        out.append({"name": f"churn.{name}", "value": value, "unit": unit, "setup": setup,
                    "machine": machine})  # fmt: skip

    add("completed_per_s", c["completed_per_s"], "items/s")
    add("written_per_s", c["written_per_s"], "rows/s")
    for origin, figs in c["lag"].items():
        if isinstance(figs, dict):
            for k in ("p50_ms_median", "p99_ms_median", "p99_ms_worst", "max_ms"):
                add(f"lag.{origin}.{k}", figs.get(k), "ms")
    add("keeper_uss_max_bytes", c["keeper_uss_max_bytes"], "bytes")
    for store in ("churned", "fresh"):
        for k in ("first_publish_s", "live_s", "exact_s"):
            add(f"kill.{store}.{k}", doc[store]["kill"][k], "s")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/bench_churn.py", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--write-rate", type=float, default=1000.0, help="producer rows/s (POST /rows)")
    p.add_argument("--procs", type=int, default=2, help="claimer processes")
    p.add_argument("--workers", type=int, default=2, help="the node's HTTP workers")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    db = template(args.rows, args.results)
    doc: dict[str, Any] = {"rows": args.rows, "minutes": args.minutes, "procs": args.procs,
                           "write_rate": args.write_rate, "batch": BATCH,
                           "loadavg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip
    doc["empty_keeper_uss_bytes"] = empty_keeper_uss(args)
    doc["churned"] = churn(db, args)
    doc["fresh"] = fresh(db, args)
    doc["loadavg_end_1m"] = round(os.getloadavg()[0], 2)
    _table(doc)
    line = json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%S"), **doc})
    args.results.mkdir(parents=True, exist_ok=True)
    with open(args.results / "churn.jsonl", "a") as f:
        f.write(line + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"records": records(doc), "run": doc}, indent=1) + "\n")
        print(f"figures -> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
