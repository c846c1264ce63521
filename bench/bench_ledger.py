"""Durable completions/s over IPC with group commit: C client processes, each
completing its own leases one per call (1 KiB results), against a real
`python -m workers.ledger` (SQLite store, segment log with fsync=batch).

usage: bench_ledger.py CLIENTS PER_CLIENT [ITEMS_PER_CALL] [--json PATH]
env QUEUE_NODE_LEDGER_GROUP_WINDOW_S sets the ledger's group window; env PROF=FILE
runs the ledger under cProfile (its stats to FILE at its stop).
Reports, besides the rate, the ledger process's CPU (user + system, from
/proc) per completion while the clients ran: ledger_cpu_us_per_item.
"""

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import add_json_option, keep, write_json
from node.core.config import Config
from node.core.rows import RowWrite
from node.ipc import IpcClient, IpcError
from node.store import open_store
from shm.leases import LeaseTable
from workers.ledger.process import ledger_address


def client(name, keys, versions, per_call, start, out):
    table = LeaseTable.attach(name)
    c = IpcClient(ledger_address(name), timeout_s=60)
    now = time.time()
    leases = [table.grant(k, "bench", 600, now, 3600, versions[k]) for k in keys]
    body = b'"' + b"x" * 1022 + b'"'
    start.wait()
    t0 = time.perf_counter()
    lat = []
    for i in range(0, len(leases), per_call):
        items = [
            {"lease_id": lease.lease_id, "key": lease.key, "result": body, "encoding": "json"}
            for lease in leases[i : i + per_call]
        ]
        a = time.perf_counter()
        r = c.call("complete", items=items)
        lat.append(time.perf_counter() - a)
        assert all(o["status"] == "ok" for o in r["outcomes"]), r
    out.put((time.perf_counter() - t0, sorted(lat)))
    table.close()


def _cpu_s(pid):
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("clients", type=int)
    parser.add_argument("per_client", type=int)
    parser.add_argument("per_call", type=int, nargs="?", default=1)
    add_json_option(parser)
    args = parser.parse_args()
    n_clients, per_client, per_call = args.clients, args.per_client, args.per_call
    name = "bench-" + uuid.uuid4().hex[:8]
    d = Path(tempfile.mkdtemp(prefix="bench-ledger-"))
    window_s = float(os.environ.get("QUEUE_NODE_LEDGER_GROUP_WINDOW_S", "0") or 0)
    cfg = Config(data_dir=d, name=name, store=f"sqlite:///{d}/schedule.db",
                 ledger_group_window_s=window_s)  # fmt: skip
    (d / "run.json").write_text(json.dumps(cfg.to_json()))
    store = open_store(cfg.store_url)
    keys = [[f"c{c}/k{i}" for i in range(per_client)] for c in range(n_clients)]
    now = time.time()
    store.upsert(
        [RowWrite(k, "r", cadence_s=3600, due_at=now - 10, job="j") for ks in keys for k in ks],
        now=now,
    )
    versions = {k: r.version for k, r in store.get_many([k for ks in keys for k in ks]).items()}
    store.close()
    table = LeaseTable.create(name, capacity=max(1024, 2 * n_clients * per_client))
    env = dict(
        os.environ,
        QUEUE_NODE_RUN_CONFIG=str(d / "run.json"),
        QUEUE_NODE_SUPERVISOR_PID=str(os.getpid()),
    )
    p = subprocess.Popen(
        [
            sys.executable,
            *(["-m", "cProfile", "-o", os.environ["PROF"]] if os.environ.get("PROF") else []),
            "-m",
            "workers.ledger",
        ],
        env=env,
        cwd=str(Path(__file__).resolve().parent.parent),
        stderr=subprocess.DEVNULL,
    )
    try:
        c = IpcClient(ledger_address(name), timeout_s=5)
        for _ in range(500):
            try:
                c.call("stats")
                break
            except IpcError:
                time.sleep(0.01)
        start, out = mp.Event(), mp.Queue()
        procs = [
            mp.Process(target=client, args=(name, keys[i], versions, per_call, start, out))
            for i in range(n_clients)
        ]
        for pr in procs:
            pr.start()
        time.sleep(1.0)
        cpu0 = _cpu_s(p.pid)
        t0 = time.perf_counter()
        start.set()
        res = [out.get() for _ in procs]
        wall = time.perf_counter() - t0
        cpu = _cpu_s(p.pid) - cpu0
        for pr in procs:
            pr.join()
        st = c.call("stats")
        lat = sorted(x for _, sample in res for x in sample)
        total = n_clients * per_client
        print(
            json.dumps(
                keep(
                    {
                        "bench": "ledger",
                        "clients": n_clients,
                        "per_client": per_client,
                        "per_call": per_call,
                        "window_s": window_s,
                        "completions_per_s": round(total / wall),
                        "calls": len(lat),
                        "p50_ms": round(1000 * lat[len(lat) // 2], 3),
                        "p99_ms": round(1000 * lat[int(len(lat) * 0.99)], 3),
                        "groups": st["groups"],
                        "items_per_group": round(total / max(1, st["groups"]), 2),
                        "flush_ms_mean": st["flush_ms_mean"],
                        "ledger_cpu_us_per_item": round(1e6 * cpu / total, 1),
                        "ledger_cpu_share": round(cpu / wall, 2),
                        "balanced": c.call("accounting")["balanced"],
                    }
                )
            )
        )
        write_json(args.json)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)
        table.close()
        LeaseTable.unlink(name)
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
