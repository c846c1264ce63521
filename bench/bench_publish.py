"""The keeper's republish while claimers hold many leases.

    .venv/bin/python bench/bench_publish.py [--rows 250000] [--grants 3000] [--rounds 40]

A real Keeper (``keeper/process.py``) over a copy of the claim bench's SQLite
template (``bench_claims.template``: ``rows`` rows, every one due), with a
real ready set, state buffer and lease table in shared memory. Each round
grants the first ``grants`` keys of the published set (as claimers would)
and times ``Keeper.publish``: learning the lease changes, detaching the newly
leased keys, the best K and the ready-set write. Reports p50 / max over the
second half of the rounds (by then ~``rounds/2 × grants`` leases are live),
and with ``--profile`` a cProfile of those rounds (by cumulative and by own
time). The machine is shared: compare figures from one sitting, runs
interleaved.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import bench_claims  # noqa: E402
from keeper.process import Keeper  # noqa: E402
from node.core.config import Config  # noqa: E402
from node.store import open_store  # noqa: E402
from shm.leases import LeaseTable  # noqa: E402
from shm.ready import ReadySet  # noqa: E402
from shm.state import StateBuffer  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=250_000)
    p.add_argument("--grants", type=int, default=3000, help="leases granted between publishes")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--ready-size", type=int, default=5000)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()

    name = f"bp{uuid.uuid4().hex[:8]}"
    capacity = 1 << max(16, (args.grants * args.rounds * 2 - 1).bit_length())
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "schedule.db"
        shutil.copy(bench_claims.template(args.rows), db)
        store = open_store(f"sqlite:///{db}")
        ready = ReadySet.create(name, args.ready_size)
        state = StateBuffer.create(name, started_at=time.time())
        leases = LeaseTable.create(name, capacity=capacity, max_misses=10)
        try:
            config = Config(name=name, workers=1, ready_size=args.ready_size)
            keeper = Keeper(config, store, ready, state, leases=leases)
            now = time.time()
            keeper.start(now)
            while keeper.status != "live":
                keeper.tick(now)
            keeper.publish(now)
            times: list[float] = []
            prof = cProfile.Profile()
            for rnd in range(args.rounds):
                for entry in ready.snapshot().entries[: args.grants]:
                    leases.grant(entry.key, "bench", 600, now, 86400)
                measured = rnd >= args.rounds // 2
                if measured and args.profile:
                    prof.enable()
                t0 = time.perf_counter()
                keeper.publish(now)
                spent = time.perf_counter() - t0
                if measured and args.profile:
                    prof.disable()
                if measured:
                    times.append(spent * 1000)
            times.sort()
            out = {
                "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "bench": "keeper_publish",
                "rows": args.rows,
                "live_leases": leases.live_count(),
                "grants_per_round": args.grants,
                "p50_ms": round(times[len(times) // 2], 3),
                "max_ms": round(times[-1], 3),
            }
            print(json.dumps(out))
            if args.profile:
                stats = pstats.Stats(prof)
                stats.sort_stats("cumulative").print_stats(15)
                stats.sort_stats("tottime").print_stats(15)  # where the time itself goes
        finally:
            for seg in (ready, state, leases):
                seg.close()
            ReadySet.unlink(name)
            StateBuffer.unlink(name)
            LeaseTable.unlink(name)
            store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
