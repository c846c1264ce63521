"""Lease table figures (issue 3, item 1).

    .venv/bin/python bench/bench_leases.py cas
    .venv/bin/python bench/bench_leases.py grant --procs 1 --seconds 5
    .venv/bin/python bench/bench_leases.py grant --procs 2 --seconds 5
    .venv/bin/python bench/bench_leases.py scan --live 5000 50000 130000
    .venv/bin/python bench/bench_leases.py all

- cas: ns per compare-and-swap (and load, fetch-add) on a shared mapping, for
  each primitive this machine has: the shm._atomic extension, a ctypes call
  into libatomic, and the ``atomics`` package when it is installed;
- grant: grants/s and grant latency p50/p99 for N processes at once (the
  grant in C and, ``--path python``, the Python grant it falls back to), each
  granting random keys and completing every lease at once, in two shapes:
  ``existing`` (keys that already have an idle slot) and ``new`` (every key
  new: the insert path);
- scan: what the keeper pays for ``excluded_keys(now)`` and the ledger for
  ``expire(now)`` (skipped by the next-expiry hint, and the full scan),
  and ``save``/``load``, with N live leases (a tenth of them held) in a
  65,536-slot table (262,144 slots above 50,000 leases). ``excluded_keys``
  four ways: the C scan at a table object's first call (``first``: every
  key decoded), again (``ms``: the keeper's steady state, the keys' str objects
  kept from the last call), after 1% of the leases ended and as many new ones
  were granted (``churn``), and the slot-by-slot Python scan it replaced
  (``py``, ``_excluded_keys_py``); and ``excluded_changes(now)``, what the
  keeper calls, through a second table object: after the same 1% churn
  (``changes_churn``) and with nothing changed (``changes_none``).

Results are printed as JSON lines and appended to bench/results/leases.jsonl.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import multiprocessing
import os
import random
import sys
import tempfile
import time
import timeit
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shm import _atomic  # noqa: E402
from shm.leases import DEFAULT_CAPACITY, EARLIEST_EXPIRY, LeaseTable, Refused  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SPAWN = multiprocessing.get_context("spawn")
KEY = "https://example.com/items/{:010d}/some-slug-text"


def _report(doc: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    doc = {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpus": os.cpu_count(), **doc}
    line = json.dumps(doc)
    print(line, flush=True)
    with open(RESULTS / "leases.jsonl", "a") as f:
        f.write(line + "\n")


def _ns(stmt: str, env: dict, number: int) -> float:
    return round(timeit.timeit(stmt, globals=env, number=number) / number * 1e9, 1)


# -- cas ----------------------------------------------------------------------


def bench_cas(number: int) -> None:
    mm = mmap.mmap(-1, 4096)
    view = _atomic.View(mm)
    doc = {
        "bench": "cas",
        "python_call_ns": _ns("f()", {"f": lambda: None}, number),
        "ext_cas64_ns": _ns("cas(0, 0, 0)", {"cas": view.cas64}, number),
        "ext_cas64_failing_ns": _ns("cas(0, 1, 0)", {"cas": view.cas64}, number),
        "ext_load64_ns": _ns("load(0)", {"load": view.load64}, number),
        "ext_add64_ns": _ns("add(8, 1)", {"add": view.add64}, number),
    }
    lib = ctypes.util.find_library("atomic")
    if lib:
        libatomic = ctypes.CDLL(lib)
        cas = libatomic.__atomic_compare_exchange_8
        cas.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_int,
            ctypes.c_int,
        ]
        cas.restype = ctypes.c_bool
        buf = (ctypes.c_char * 4096).from_buffer(mm)
        expected = ctypes.c_uint64(0)
        env = {"cas": cas, "at": ctypes.addressof(buf), "exp": ctypes.addressof(expected)}
        doc["ctypes_libatomic_cas_ns"] = _ns("cas(at, exp, 0, 5, 5)", env, number)
        del buf
    else:
        doc["ctypes_libatomic_cas_ns"] = None  # libatomic1 is not installed
    try:
        import atomics
    except ImportError:
        doc["atomics_pkg_cas_ns"] = None  # not installed
    else:
        with atomics.atomicview(buffer=memoryview(mm)[16:24], atype=atomics.UINT) as a:
            doc["atomics_pkg_cas_ns"] = _ns("a.cmpxchg_strong(0, 0)", {"a": a}, number // 20)
    view.release()
    mm.close()
    _report(doc)


# -- grant ------------------------------------------------------------------------


def _granter(
    node: str, shape: str, seed: int, seconds: float, keys: int, out, go, path: str = "c"
) -> None:
    table = LeaseTable.attach(node)
    if path == "python":  # the Python grant only (the C grant's fallback)
        table._granter.release()
        table._granter = None
    rnd = random.Random(seed)
    lat: list[int] = []
    refused = 0
    go.wait(30)
    serial = seed << 40
    end = time.monotonic() + seconds
    clock = time.perf_counter_ns
    while time.monotonic() < end:
        for _ in range(200):
            if shape == "new":
                serial += 1
                key = KEY.format(serial)
            else:
                key = KEY.format(rnd.randrange(keys))
            now = time.time()
            t0 = clock()
            lease = table.grant(key, "bench", 60, now, 3600)
            lat.append(clock() - t0)
            if isinstance(lease, Refused):
                refused += 1
            else:
                table.complete(key, lease.lease_id, now)
    table.close()
    out.put((lat, refused))


def bench_grant(procs: int, seconds: float, shape: str, keys: int, path: str = "c") -> None:
    node = f"bench-{uuid.uuid4().hex[:8]}"
    table = LeaseTable.create(node, DEFAULT_CAPACITY)
    try:
        if shape == "existing":  # give every key its idle slot first
            now = time.time()
            for i in range(keys):
                lease = table.grant(KEY.format(i), "bench", 60, now, 3600)
                table.complete(KEY.format(i), lease.lease_id, now)
        out, go = SPAWN.Queue(), SPAWN.Event()
        children = [
            SPAWN.Process(
                target=_granter, args=(node, shape, i + 1, seconds, keys, out, go, path)
            )
            for i in range(procs)
        ]
        for child in children:
            child.start()
        go.set()
        results = [out.get(timeout=seconds + 60) for _ in children]
        for child in children:
            child.join(30)
        stats = table.stats()
    finally:
        table.close()
        LeaseTable.unlink(node)
    lat = sorted(x for lats, _ in results for x in lats)
    _report(
        {
            "bench": "grant",
            "path": path,
            "shape": shape,
            "procs": procs,
            "seconds": seconds,
            "grants": len(lat),
            "grants_per_s": round(len(lat) / seconds),
            "grant_us_p50": round(lat[len(lat) // 2] / 1000, 2),
            "grant_us_p99": round(lat[int(len(lat) * 0.99)] / 1000, 2),
            "grant_us_max": round(lat[-1] / 1000, 1),
            "refused": sum(r for _, r in results),
            "backoffs": stats["backoffs"],
            "max_probe": stats["max_probe"],
            "note": "each grant is followed by a complete (not timed)",
        }
    )


# -- scans --------------------------------------------------------------------------


def _timed(fn, repeat: int = 5, before=None) -> float:
    """Best of ``repeat`` runs of ``fn``, in ms; ``before`` runs untimed first."""
    best = float("inf")
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1000, 2)


def bench_scan(live: int) -> None:
    node = f"bench-{uuid.uuid4().hex[:8]}"
    capacity = DEFAULT_CAPACITY if live <= 50_000 else 1 << (2 * live - 1).bit_length()
    table = LeaseTable.create(node, capacity)
    now = time.time()
    try:
        for i in range(live):
            table.grant(KEY.format(i), "bench", 600, now, 3600)
        held = live // 10  # a tenth of them missed: held
        for lease in table.live(limit=held):
            table.release(lease.key, lease.lease_id, now)
        excluded = table.excluded_keys(now)
        assert excluded == table._excluded_keys_py(now)

        def forget() -> None:  # as at a table object's first call
            table._key_cache = None

        serial = iter(range(live, 1 << 62))
        churned = max(1, live // 100)

        def churn() -> None:  # 1% of the leases end, as many new keys are granted
            for lease in table.live(limit=churned):
                table.complete(lease.key, lease.lease_id, now)
            for _ in range(churned):
                table.grant(KEY.format(next(serial)), "bench", 600, now, 3600)

        excluded_py_ms = _timed(lambda: table._excluded_keys_py(now))
        excluded_first_ms = _timed(lambda: table.excluded_keys(now), before=forget)
        excluded_ms = _timed(lambda: table.excluded_keys(now))
        excluded_churn_ms = _timed(lambda: table.excluded_keys(now), before=churn)
        with LeaseTable.attach(node) as follower:  # its own cache, as the keeper's
            follower.excluded_changes(now)
            changes_churn_ms = _timed(lambda: follower.excluded_changes(now), before=churn)
            changes_none_ms = _timed(lambda: follower.excluded_changes(now))
        probe = [KEY.format(i) for i in range(0, 2 * live, max(1, live // 500))]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "leases.msgpack"
            save_ms = _timed(lambda: table.save(path, now), 1)
            size = path.stat().st_size
            other = f"bench-{uuid.uuid4().hex[:8]}"
            with LeaseTable.create(other, capacity) as fresh:
                t0 = time.perf_counter()
                loaded = fresh.load(path)
                load_ms = round((time.perf_counter() - t0) * 1000, 2)
            LeaseTable.unlink(other)
        doc = {
            "bench": "scan",
            "capacity": table.capacity,
            "live": live,
            "held": held,
            "excluded": len(excluded),
            "excluded_keys_ms": excluded_ms,
            "excluded_keys_first_ms": excluded_first_ms,
            "excluded_keys_churn_ms": excluded_churn_ms,
            "excluded_keys_py_ms": excluded_py_ms,
            "churned": 2 * churned,
            "excluded_changes_churn_ms": changes_churn_ms,
            "excluded_changes_none_ms": changes_none_ms,
            "excluded_keys_speedup": round(excluded_py_ms / excluded_ms, 1),
            "excluded_keys_first_speedup": round(excluded_py_ms / excluded_first_ms, 1),
            # The ledger's sweep, none due: skipped by the next-expiry hint,
            # and with the hint unknown (0), the full scan it skips.
            "expire_nothing_due_ms": _timed(lambda: table.expire(now)),
            "expire_full_scan_ms": _timed(
                lambda: table.expire(now), before=lambda: table._view.store64(EARLIEST_EXPIRY, 0)
            ),
            "is_excluded_us": round(
                _timed(lambda: [table.is_excluded(k, now) for k in probe]) * 1000 / len(probe), 2
            ),
            "stats_ms": _timed(table.stats),
            "save_ms": save_ms,
            "save_bytes": size,
            "load_ms": load_ms,
            "loaded": loaded,
        }
    finally:
        table.close()
        LeaseTable.unlink(node)
    _report(doc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["cas", "grant", "scan", "all"])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument(
        "--shape", choices=["existing", "new"], nargs="+", default=["existing", "new"]
    )
    parser.add_argument(
        "--path", choices=["c", "python"], nargs="+", default=["c", "python"],
        help="the grant in C (shm/_claim.c) or the Python grant it falls back to",
    )
    parser.add_argument("--live", type=int, nargs="+", default=[5_000, 50_000, 130_000])
    parser.add_argument("--number", type=int, default=1_000_000)
    args = parser.parse_args()
    if args.what in ("cas", "all"):
        bench_cas(args.number)
    if args.what in ("grant", "all"):
        for shape in args.shape:
            for procs in args.procs:
                for path in args.path:
                    bench_grant(procs, args.seconds, shape, args.keys, path)
    if args.what in ("scan", "all"):
        for live in args.live:
            bench_scan(live)


if __name__ == "__main__":
    main()
