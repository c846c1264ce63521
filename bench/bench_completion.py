"""Completion-log figures for issue 3, item 4, measured on real segment files.

    .venv/bin/python bench/bench_completion.py commit  [--seconds 3] [--batches 1,64,512]
    .venv/bin/python bench/bench_completion.py recover [--results 1000000] [--pending 1.0]
    .venv/bin/python bench/bench_completion.py recover --profile   # where the time goes

- commit: durable results per second with group commit: append a batch of
  1 KiB results, flush (one write, one fsync), repeat for --seconds; per
  batch size. ``fsync="batch"``, the default policy.
- recover: write --results results of 1 KiB in the current segment format
  (2: docs/completion-log.md, "Format 2: measured"; fsync="never" to build the
  file quickly, then one fsync), ack all but a --pending fraction of them,
  close, and time ``recover()`` of a fresh store: warm (files in the page
  cache) and cold (after posix_fadvise(DONTNEED) on every segment).
  Target: 1,000,000 results of 1 KiB in at most 2 s.

Files go to a temporary directory (``--dir`` to choose its parent: the disk
is what is measured) and are removed. Results are printed as JSON lines;
``--save`` also appends them to bench/results/completion.jsonl.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_json_option, keep, write_json  # noqa: E402
from node.completion.base import CompletionConfig, Result  # noqa: E402
from node.completion.segments import SegmentStore  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULT_BYTES = 1024


def _report(doc: dict, save: bool) -> None:
    doc = {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), **doc}
    line = json.dumps(keep(doc))
    print(line, flush=True)
    if save:
        results = ROOT / "bench" / "results"
        results.mkdir(exist_ok=True)
        with open(results / "completion.jsonl", "a") as f:
            f.write(line + "\n")


def _results(start: int, n: int, payload: bytes, now: float) -> list[Result]:
    return [
        Result(
            key=f"https://example.com/items/{i:010d}/some-slug-text-{i % 97:02d}",
            job=f"job-{i % 4}",
            lease_id=i,
            version=1000 + i,
            finished_at=now + i * 1e-3,
            cadence_s=3600,
            data=payload,
        )
        for i in range(start, start + n)
    ]


def bench_commit(args: argparse.Namespace) -> None:
    payload = os.urandom(RESULT_BYTES)
    for batch in [int(b) for b in args.batches.split(",")]:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            store = SegmentStore(Path(tmp) / "completion", CompletionConfig(fsync="batch"))
            store.recover()
            template = _results(0, batch, payload, time.time())
            done = flushes = 0
            latencies = []
            t0 = time.perf_counter()
            deadline = t0 + args.seconds
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                store.append_results(template)
                store.flush()
                latencies.append(time.perf_counter() - t)
                done += batch
                flushes += 1
            elapsed = time.perf_counter() - t0
            store.close()
            latencies.sort()
            _report(
                {
                    "bench": "completion_commit",
                    "fsync": "batch",
                    "batch": batch,
                    "result_bytes": RESULT_BYTES,
                    "flushes": flushes,
                    "durable_per_s": round(done / elapsed),
                    "flush_ms_p50": round(latencies[len(latencies) // 2] * 1e3, 3),
                    "flush_ms_p99": round(latencies[int(len(latencies) * 0.99)] * 1e3, 3),
                },
                args.save,
            )


def _build(path: Path, n: int, pending: float) -> None:
    payload = os.urandom(RESULT_BYTES)
    store = SegmentStore(path, CompletionConfig(fsync="never"))
    store.recover()
    now = time.time()
    step = 10_000
    keep_every = max(1, round(1 / pending)) if pending > 0 else 0
    for start in range(0, n, step):
        ids = store.append_results(_results(start, min(step, n - start), payload, now))
        store.flush()
        if pending < 1.0:
            store.ack([i for i in ids if not keep_every or i % keep_every])
    store.flush()
    store.close()
    for name in os.listdir(path):
        fd = os.open(path / name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def _evict(path: Path) -> None:
    for name in os.listdir(path):
        fd = os.open(path / name, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _recover_once(path: Path) -> tuple[float, dict]:
    gc.collect()
    store = SegmentStore(path)
    t0, c0 = time.perf_counter(), time.process_time()
    report = store.recover()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    store.close()
    return elapsed, {
        "cpu_s": round(cpu, 3),
        "segments": report.segments,
        "records": report.records,
        "pending": report.pending,
        "bytes": report.bytes_read,
    }


def bench_recover(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "completion"
        t0 = time.perf_counter()
        _build(path, args.results, args.pending)
        build_s = time.perf_counter() - t0
        if args.profile:
            store = SegmentStore(path)
            prof = cProfile.Profile()
            prof.enable()
            store.recover()
            prof.disable()
            store.close()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
            return
        warm = [_recover_once(path) for _ in range(args.repeat)]
        _evict(path)
        cold_s, cold = _recover_once(path)
        best_s, shape = min(warm, key=lambda run: run[0])
        target_s = 2.0 * args.results / 1_000_000
        _report(
            {
                "bench": "completion_recover",
                "results": args.results,
                "pending_fraction": args.pending,
                "result_bytes": RESULT_BYTES,
                "segments": shape["segments"],
                "records": shape["records"],
                "pending": shape["pending"],
                "bytes": shape["bytes"],
                "build_s": round(build_s, 2),
                "warm_s": [round(s, 3) for s, _ in warm],
                "warm_cpu_s": [run["cpu_s"] for _, run in warm],
                "warm_best_s": round(best_s, 3),
                "warm_results_per_s": round(args.results / best_s),
                "warm_mb_per_s": round(shape["bytes"] / best_s / 1e6),
                "cold_s": round(cold_s, 3),
                "cold_cpu_s": cold["cpu_s"],
                "load_avg_1m": os.getloadavg()[0],
                "target_s": target_s,
                "met": best_s <= target_s,
            },
            args.save,
        )
    shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("commit")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--batches", default="1,64,512")
    p = sub.add_parser("recover")
    p.add_argument("--results", type=int, default=1_000_000)
    p.add_argument("--pending", type=float, default=1.0, help="fraction left unacked")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    for p in sub.choices.values():
        p.add_argument("--dir", default=None, help="parent of the temporary directory")
        p.add_argument("--save", action="store_true")
        add_json_option(p)
    args = parser.parse_args()
    {"commit": bench_commit, "recover": bench_recover}[args.cmd](args)
    write_json(args.json)


if __name__ == "__main__":
    main()
