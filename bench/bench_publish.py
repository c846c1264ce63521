"""The keeper's publish: from the decision to publish until the ready set is written.

    .venv/bin/python bench/bench_publish.py [--rows 250000] [--grants 3000] [--rounds 200]
        [--window 10] [--exclude 3000] [--reps 200] [--profile]

A real Keeper (``keeper/process.py``) over a copy of the claim bench's SQLite
template (``bench_claims.template``: ``rows`` rows, every one due), with a
real ready set, state buffer and lease table in shared memory.

The keeper's rounds: each round grants the first ``grants`` keys of the
published set (as claimers would), completes the leases granted ``window``
rounds before (so the live leases stay about ``window × grants`` and the
rounds can be many), and times ``Keeper.publish`` (a fresh set, K =
``ready-size``), stamped at three points: the call (the decision to
publish), the start of the best K (after the lease changes are learnt and the
live sets retired: the newly leased keys detached, the retired set's others
attached), and the return of the ready set's write (the set is written). It
reports, p50 and max over every round but the first ``window``:
``decision_to_written`` (all of it), ``best_to_written`` (the best K from the
class orders to the set written, the excluded keys detached already) and
``publish`` (the whole call, with the bookkeeping after the write: the keys
written detached).

The exclude figure: ``best 5,000`` of the keeper's buckets with an
``exclude`` set of ``exclude`` keys (the best ones, so each is passed over)
written into a ready set, and the same with none excluded, timed alone
``reps`` times each, alternated (p50 and max): ``Buckets.best_gathered`` and
``ReadySet.publish_gathered``, or on a build before them ``best_columns`` and
``publish_columns``, so the one script measures both (run it from each tree).

With ``--profile``, a cProfile of the measured rounds (by cumulative and by
own time). The machine is shared: compare figures from one sitting, runs
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
from bench.common import add_json_option, keep, write_json  # noqa: E402
from keeper.process import Keeper  # noqa: E402
from node.core.config import Config  # noqa: E402
from node.store import open_store  # noqa: E402
from shm.leases import LeaseTable  # noqa: E402
from shm.ready import ReadySet  # noqa: E402
from shm.state import StateBuffer  # noqa: E402


def _stamp(obj, names: tuple[str, ...], stamps: dict[str, float], key: str, at_end: bool):
    """Wrap the methods ``names`` of ``obj`` (those it has) to note the time
    in ``stamps[key]`` on entry, or on return (``at_end``)."""
    for name in names:
        method = getattr(obj, name, None)
        if method is None:
            continue

        def wrapped(*args, _method=method, **kwargs):
            if not at_end:
                stamps[key] = time.perf_counter()
            out = _method(*args, **kwargs)
            if at_end:
                stamps[key] = time.perf_counter()
            return out

        setattr(obj, name, wrapped)


def _best_and_write(buckets, ready, now: float, k: int, exclude) -> int:
    """The best ``k`` (``exclude`` passed over) written into ``ready``."""
    if hasattr(buckets, "best_gathered"):
        picked = buckets.best_gathered(now, k, exclude=exclude)
        written = ready.publish_gathered(*picked[:7], now)  # a list of keys before 2026-12-05
        return written if isinstance(written, int) else len(written)
    return ready.publish_columns(*buckets.best_columns(now, k, exclude=exclude), now)


def _p50_max(times: list[float]) -> tuple[float, float]:
    times = sorted(times)
    return round(times[len(times) // 2], 3), round(times[-1], 3)


def _rounds(
    keeper, ready, leases, now: float, args
) -> tuple[dict[str, list[float]], cProfile.Profile]:
    """The keeper's rounds: grant, complete the leases ``window`` rounds
    old, publish; each measured publish's phases, in ms."""
    stamps: dict[str, float] = {}
    _stamp(keeper.buckets, ("best_columns", "best_gathered"), stamps, "best", False)
    _stamp(ready, ("publish_columns", "publish_gathered"), stamps, "written", True)
    phases: dict[str, list[float]] = {
        "decision_to_written": [], "best_to_written": [], "publish": []
    }  # fmt: skip
    granted: list[list[tuple[str, int]]] = []
    prof = cProfile.Profile()
    for rnd in range(args.rounds):
        if len(granted) >= args.window:
            for key, lease_id in granted.pop(0):
                leases.complete(key, lease_id, now)
        took = []
        for entry in ready.snapshot().entries[: args.grants]:
            lease = leases.grant(entry.key, "bench", 600, now, 86400)
            lease_id = getattr(lease, "lease_id", None)
            if lease_id is not None:
                took.append((entry.key, lease_id))
        granted.append(took)
        measured = rnd >= args.window
        if measured and args.profile:
            prof.enable()
        t0 = time.perf_counter()
        keeper.publish(now)
        end = time.perf_counter()
        if measured and args.profile:
            prof.disable()
        if measured:
            phases["decision_to_written"].append((stamps["written"] - t0) * 1000)
            phases["best_to_written"].append((stamps["written"] - stamps["best"]) * 1000)
            phases["publish"].append((end - t0) * 1000)
    return phases, prof


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=250_000)
    p.add_argument("--grants", type=int, default=3000, help="leases granted between publishes")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--window", type=int, default=10, help="rounds a lease lives before completed")
    p.add_argument("--ready-size", type=int, default=5000)
    p.add_argument("--exclude", type=int, default=3000, help="keys excluded, the exclude figure")
    p.add_argument("--reps", type=int, default=200, help="repetitions of the exclude figure")
    p.add_argument("--profile", action="store_true")
    add_json_option(p)
    args = p.parse_args()

    name = f"bp{uuid.uuid4().hex[:8]}"
    capacity = 1 << max(16, (args.grants * (args.window + 2) * 2 - 1).bit_length())
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "schedule.db"
        shutil.copy(bench_claims.template(args.rows), db)
        store = open_store(f"sqlite:///{db}")
        ready = ReadySet.create(name, args.ready_size)
        state = StateBuffer.create(name, started_at=time.time())
        leases = LeaseTable.create(name, capacity=capacity, max_misses=10)
        other = f"{name}x"
        spare = ReadySet.create(other, args.ready_size)
        try:
            config = Config(name=name, workers=1, ready_size=args.ready_size)
            keeper = Keeper(config, store, ready, state, leases=leases)
            now = time.time()
            keeper.start(now)
            while keeper.status != "live":
                keeper.tick(now)
            keeper.publish(now)
            phases, prof = _rounds(keeper, ready, leases, now, args)
            out: dict[str, object] = {
                "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "bench": "keeper_publish",
                "build": "gathered" if hasattr(keeper.buckets, "best_gathered") else "columns",
                "rows": args.rows,
                "ready_size": args.ready_size,
                "live_leases": leases.live_count(),
                "grants_per_round": args.grants,
                "rounds_measured": len(phases["publish"]),
            }
            for phase, times in phases.items():
                out[f"{phase}_p50_ms"], out[f"{phase}_max_ms"] = _p50_max(times)
            # The exclude figure: the keeper's buckets, best K with the best
            # ``exclude`` keys excluded, and with none; alternated.
            buckets = keeper.buckets
            head = set(buckets.best(now, args.exclude))
            exclude = {entry[0] for entry in head}
            times_by: dict[int, list[float]] = {len(exclude): [], 0: []}
            for _ in range(args.reps):
                for excl in (exclude, None):
                    t0 = time.perf_counter()
                    written = _best_and_write(buckets, spare, now, args.ready_size, excl)
                    times_by[len(excl) if excl else 0].append((time.perf_counter() - t0) * 1000)
                    assert written == args.ready_size
            for n, times in times_by.items():
                out[f"best_written_excl{n}_p50_ms"], out[f"best_written_excl{n}_max_ms"] = (
                    _p50_max(times)
                )
            print(json.dumps(keep(out)))
            write_json(args.json)
            if args.profile:
                stats = pstats.Stats(prof)
                stats.sort_stats("cumulative").print_stats(15)
                stats.sort_stats("tottime").print_stats(15)  # where the time itself goes
        finally:
            for seg in (ready, state, leases, spare):
                seg.close()
            ReadySet.unlink(name)
            ReadySet.unlink(other)
            StateBuffer.unlink(name)
            LeaseTable.unlink(name)
            store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
