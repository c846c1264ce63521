"""Poll latency against the backlog: 1,000 to 1,000,000 results pending.

    .venv/bin/python bench/bench_poll.py [--sizes 1000 10000 100000 1000000] [--polls 300]

What the ledger does for ``GET /jobs/{job}/results?max=100`` (and
``/results``), in-process and without the network: ``Delivery.poll`` picks the
ids to offer, and each offered result is read back from the segment files
(``SegmentStore.read_result``, the payload's checksum checked), as
``Ledger.offer`` does; the offers are then handed back untimed, so every poll
sees the whole backlog. The store holds ``size`` pending 1 KiB
results over four jobs, recovered from disk the way a restarted ledger
rebuilds its queues. Reports p50 / p99 of one poll of 100 at each size, for
one job and across all jobs, and the ratio of the largest size's p50 to the
smallest's (target: at most 1.5, the cost follows what a poll returns).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_completion import RESULT_BYTES, _results  # noqa: E402
from bench.common import add_json_option, keep, write_json  # noqa: E402
from node.completion.base import CompletionConfig  # noqa: E402
from node.completion.segments import SegmentStore  # noqa: E402
from workers.ledger.delivery import Delivery  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BUILD_STEP = 10_000


def _build(path: Path, n: int) -> None:
    payload = os.urandom(RESULT_BYTES)
    store = SegmentStore(path, CompletionConfig(fsync="never"))
    store.recover()
    now = time.time()
    for start in range(0, n, BUILD_STEP):
        store.append_results(_results(start, min(BUILD_STEP, n - start), payload, now))
        store.flush()
    store.close()


def _polls(store: SegmentStore, delivery: Delivery, job: str | None, polls: int) -> list[float]:
    """Time ``polls`` polls of 100 (pick, read back). Each poll's offers are
    handed back untimed (as an offer not acked in time is), so the backlog
    stays at its size for every poll."""
    times = []
    for _ in range(polls):
        now = time.time()
        t0 = time.perf_counter()
        ids = delivery.poll(job, 100, now)
        for rid in ids:
            store.read_result(rid)
        times.append(time.perf_counter() - t0)
        assert len(ids) == 100, f"a poll gave {len(ids)}"
        delivery.return_offers(ids, now)
    times.sort()
    return times


def _ms(times: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(times[len(times) // 2] * 1000, 4),
        "p99_ms": round(times[min(len(times) - 1, len(times) * 99 // 100)] * 1000, 4),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000, 1_000_000])
    p.add_argument("--polls", type=int, default=300)
    p.add_argument("--dir", default=None, help="parent of the temporary directory")
    add_json_option(p)
    args = p.parse_args()
    rows = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            path = Path(tmp)
            _build(path, size)
            store = SegmentStore(path, CompletionConfig(fsync="never"))
            store.recover()
            delivery = Delivery()
            for pending in store.pending():
                delivery.add(pending.id, pending.job)
            one = _polls(store, delivery, "job-1", args.polls)
            every = _polls(store, delivery, None, args.polls)
            store.close()
        row = {"size": size, "one_job": _ms(one), "all_jobs": _ms(every)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    first, last = rows[0], rows[-1]
    out = {
        "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "bench": "poll_latency",
        "sizes": rows,
        "ratio_one_job": round(last["one_job"]["p50_ms"] / first["one_job"]["p50_ms"], 3),
        "ratio_all_jobs": round(last["all_jobs"]["p50_ms"] / first["all_jobs"]["p50_ms"], 3),
        "target_ratio": 1.5,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "poll.jsonl", "a") as f:
        f.write(json.dumps(out) + "\n")
    print(json.dumps(keep(out)))
    write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
