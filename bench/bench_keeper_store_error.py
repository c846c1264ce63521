"""The keeper through a store error, on a real node over a large store: the
time from the store coming back to the keeper live and exact again (``GET
/queue-state`` answering 200, polled from outside every 10 ms), three ways in
one run of one node:

- ``resume``: the store's directory taken away (as an unmounted volume) for
  ``--down-s`` while ``--writes`` rows are written through the node's API,
  then put back: the keeper reopens and resumes its change feed;
- ``walk``: the same, but while the directory is away another program writes
  ``--writes`` rows into the file and trims the whole change log (a gap): the
  keeper reopens and walks the table (keeper/verify.py) to repair its copy;
- ``reload``: the old path, what a store error did before keeper/outage.py:
  the keeper process killed (``kill -9``), the supervisor starts another,
  which loads every row.

For each: seconds from the store back (or the kill) to 200, and whether the
keeper process was the same. Also: claims answered while the store was away.

    .venv/bin/python bench/bench_keeper_store_error.py --rows 1000000 --json out.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_json_option, keep, seed, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
POLL_S = 0.01


def _get(node: Any, path: str) -> tuple[int, Any]:
    try:
        return node.request("GET", path, timeout_s=5)
    except OSError:
        return 0, None


def _poll(node: Any, cond: Any, timeout_s: float, what: str) -> tuple[float, Any]:
    """Poll ``GET /queue-state`` until ``cond(status, doc)``: (seconds, doc)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        status, doc = _get(node, "/queue-state")
        if doc is not None and cond(status, doc):
            return time.monotonic() - t0, doc
        time.sleep(POLL_S)  # the polling interval of a deadline wait
    raise RuntimeError(f"{what}: not within {timeout_s} s\n{node.log()}")


def _vouched(status: int, doc: dict) -> bool:
    return status == 200 and bool(doc["trust"].get("exact"))


def _store(doc: dict) -> dict:
    return doc["trust"].get("store") or {}


def _rows(prefix: str, n: int) -> list[dict]:
    now = time.time()
    return [{"key": f"{prefix}-{i:07d}", "route": "route00", "due_at": now - 60} for i in range(n)]


def _down(node: Any, volume: Path, args: argparse.Namespace, gap: bool) -> dict:
    """Take the volume away, write meanwhile, put it back: the figures."""
    away = volume.with_name(volume.name + ".away")
    before = _store(_get(node, "/queue-state")[1])
    os.rename(volume, away)
    t_away = time.monotonic()
    try:
        _poll(node, lambda s, d: _store(d).get("state") == "unreachable", 30, "outage seen")
        status, claimed = node.request("POST", "/claim", {"max": 100, "consumer": "bench"})
        claims = len(claimed["leases"]) if status == 200 else 0
        prefix = f"{'gap' if gap else 'resume'}-{uuid.uuid4().hex[:6]}"
        if gap:  # another program: rows and a trimmed change log, in one transaction
            conn = sqlite3.connect(away / "schedule.db", isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany(
                    "INSERT INTO schedule (key, route, due_at) VALUES (?, ?, ?)",
                    [(r["key"], r["route"], r["due_at"]) for r in _rows(prefix, args.writes)],
                )
                conn.execute("DELETE FROM changes")
                conn.execute("COMMIT")
            finally:
                conn.close()
        else:  # through the node: the workers' connections still reach the file
            status, body = node.request("POST", "/rows", _rows(prefix, args.writes), timeout_s=60)
            assert status == 200, body
        while time.monotonic() - t_away < args.down_s:
            time.sleep(POLL_S)  # the outage lasts --down-s
    finally:
        os.rename(away, volume)
    # Exact, and the counts written since the store came back (trust.store ok).
    seconds, doc = _poll(node, lambda s, d: _vouched(s, d) and _store(d).get("state") == "ok"
                         and _store(d).get("walks", 0) - before.get("walks", 0) == int(gap),
                         900, "live and exact after the store came back")  # fmt: skip
    store = _store(doc)
    return {
        "back_to_exact_s": round(seconds, 3),
        "claims_during_outage": claims,
        "verdict": store.get("last_verdict"),
        "walks": store.get("walks", 0) - before.get("walks", 0),
        "keeper_down_s": store.get("last_down_s"),
        "verify_last_s": doc["trust"]["verify"].get("last_s"),
        "repairs": doc["trust"]["repairs"]["feed_missed"],
    }


def _reload(node: Any) -> dict:
    """The old path: kill -9 the keeper, time until a new one is exact."""
    pid = node.pids()["keeper"]
    started = _get(node, "/queue-state")[1]["trust"]["load"]["started_at"]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    _poll(node, lambda s, d: not d["trust"].get("exact") or not d["trust"].get("live"), 30,
          "the kill seen")  # fmt: skip
    # Exact, with the new keeper's counts (the state buffer keeps the last
    # document over a restart).
    seconds, doc = _poll(node, lambda s, d: _vouched(s, d)
                         and d["trust"]["load"]["started_at"] != started, 900,
                         "a new keeper live and exact")  # fmt: skip
    seconds = time.monotonic() - t0
    _, doc = _poll(node, lambda s, d: d["trust"]["load"].get("done_s") is not None, 30, "load_s")
    return {"back_to_exact_s": round(seconds, 3), "keeper_load_s": doc["trust"]["load"]["done_s"]}


def run(args: argparse.Namespace) -> list[dict]:
    from node.testing import NodeProcess, cleanup_segments

    template = seed(RESULTS / f"schedule-{args.rows}.db", args.rows, time.time())
    data = Path(tempfile.mkdtemp(prefix="qn-store-error-"))
    volume = data / "volume"
    volume.mkdir()
    shutil.copyfile(template, volume / "schedule.db")
    name = f"store-error-{uuid.uuid4().hex[:8]}"
    node = NodeProcess(data / "node", name, "--store", f"sqlite:///{volume / 'schedule.db'}",
                       test_hooks=False)  # fmt: skip
    out = []
    try:
        node.start(wait_ready=False, timeout_s=120)
        _poll(node, _vouched, 900, "the first load")
        first_pid = node.pids()["keeper"]
        setup = {"rows": args.rows, "down_s": args.down_s, "writes": args.writes}
        for way in args.ways:
            if way == "reload":
                figures = _reload(node)
            else:
                figures = _down(node, volume, args, gap=way == "walk")
                figures["same_keeper"] = node.pids()["keeper"] == first_pid
            value = figures["back_to_exact_s"]
            doc = keep({"name": f"keeper_store_error.{way}", "unit": "s", "value": value,
                        **figures, "setup": setup})  # fmt: skip
            print(doc, flush=True)
            out.append(doc)
            if way == "reload":
                first_pid = node.pids()["keeper"]
    finally:
        try:
            node.stop(timeout_s=120)
        except AssertionError:
            node.kill()
        cleanup_segments(name)
        shutil.rmtree(data, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--down-s", type=float, default=3.0, help="how long the store stays away")
    p.add_argument("--writes", type=int, default=1000, help="rows written while it is away")
    p.add_argument("--ways", nargs="+", default=["resume", "walk", "reload"],
                   choices=["resume", "walk", "reload"])  # fmt: skip
    add_json_option(p)
    args = p.parse_args(argv)
    run(args)
    write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
