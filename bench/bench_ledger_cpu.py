"""The ledger's CPU a completed item, in process: the lever of the whole cycle.

One process drives a real ledger (``workers.ledger.process.Ledger``) on the
real parts: a SQLite schedule, the segment log with its fsyncs, the shared
lease table. It grants leases in batches (not timed), then times only the
ledger's own calls, as the cycle makes them: ``complete`` of a batch (check,
append, group commit, write-back, lease end, offer), ``poll`` of up to 1,000
results of the job and their ``ack``. The figure is CPU seconds of this
process inside those calls a completed, delivered and acked item: what the
ledger process costs an item in ``bench/bench_cycle.py``, without the IPC,
the other processes or the machine's noise (CPU time, not wall time; the
fsync's wait is not CPU).

    python bench/bench_ledger_cpu.py [--rows 50000] [--batch 64] [--items 40000]
    python bench/bench_ledger_cpu.py --profile      # cProfile of the timed calls

Writes one JSON line (``--json`` to a file too).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.core.config import Config  # noqa: E402
from node.core.rows import RowWrite  # noqa: E402
from shm.leases import LeaseTable  # noqa: E402
from workers.ledger.process import open_ledger  # noqa: E402

RESULT = b"x" * 200
JOB = "j"
CADENCE_S = 3600.0


def seed(store, rows: int) -> list[str]:  # type: ignore[no-untyped-def]
    now = time.time()
    keys = [f"https://example.com/listing/{i:012d}/page-{i % 97:02d}" for i in range(rows)]
    for i in range(0, rows, 10_000):
        chunk = keys[i : i + 10_000]
        store.upsert(
            [RowWrite(k, "r", cadence_s=CADENCE_S, due_at=now - 5, job=JOB) for k in chunk],
            now=now,
        )
    return keys


async def drive(ledger, table, store, keys, batch: int, items: int, prof):  # type: ignore[no-untyped-def]
    ledger.recover(time.time())
    committer = asyncio.create_task(ledger.run_committer())
    cpu = 0.0
    done = acked = 0
    versions = {row.key: row.version for row in store.get_many(keys).values()}
    clock = time.process_time
    n = 0
    while done < items:
        now = time.time()
        chunk = keys[n : n + batch]
        n += batch
        if not chunk:
            break
        leases = [table.grant(k, "gpu-0", 60.0, now, CADENCE_S, versions[k]) for k in chunk]
        request = {
            "items": [
                {"lease_id": lease.lease_id, "key": lease.key, "result": RESULT,
                 "encoding": "bytes"}
                for lease in leases
            ]
        }  # fmt: skip
        if prof:
            prof.enable()
        t0 = clock()
        reply = await ledger.complete(request)
        if n % (batch * 16) == 0 or n >= items:
            polled = await ledger.poll({"job": JOB, "max": 1000})
            ids = [r["id"] for r in polled["results"]]
            if ids:
                acked += (await ledger.ack({"job": JOB, "ids": ids}))["acked"]
        cpu += clock() - t0
        if prof:
            prof.disable()
        done += sum(1 for o in reply["outcomes"] if o["status"] == "ok")
    committer.cancel()
    return cpu, done, acked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--items", type=int, default=40_000)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the timed calls")
    ap.add_argument("--json", help="also write the JSON line here")
    args = ap.parse_args()
    items = min(args.items, args.rows)
    name = f"qnlcpu{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="ledger-cpu-") as tmp:
        data_dir = Path(tmp)
        config = Config(data_dir=data_dir, name=name, store=f"sqlite:///{data_dir}/schedule.db")
        table = LeaseTable.create(name, capacity=max(1024, 2 * args.rows))
        try:
            ledger = open_ledger(config)
            keys = seed(ledger.store, args.rows)
            prof = cProfile.Profile() if args.profile else None
            cpu, done, acked = asyncio.run(drive(ledger, table, ledger.store, keys, args.batch,
                                                 items, prof))  # fmt: skip
            ledger.close()
        finally:
            table.close()
            LeaseTable.unlink(name)
    out = {
        "bench": "ledger_cpu",
        "batch": args.batch,
        "completed": done,
        "acked": acked,
        "cpu_s": round(cpu, 3),
        "us_per_item": round(1e6 * cpu / max(1, done), 2),
    }
    line = json.dumps(out)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
