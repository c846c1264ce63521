"""What durable schedule writes would cost: SQLite's ``synchronous = FULL``
against the store's ``NORMAL`` (issue 16, item 2).

The store writes the schedule in WAL mode with ``synchronous = NORMAL``: a
commit is in the WAL file at once but fsynced only at a checkpoint, so a
power loss can roll back a ``POST /rows`` answered 200 or a ledger
write-back. ``FULL`` fsyncs the WAL at every commit. This bench measures both
on the same file, the operations the node runs:

- the ledger's write-back of a group (``Store.write_back_many``, 64 and 1
  results a transaction);
- a producer's ``upsert`` (100 rows and 1 row a transaction).

It prints one JSON line a mode and operation: transactions/s, µs a
transaction (wall, so the fsync's wait counts) and µs a row.

    .venv/bin/python bench/bench_sync.py --rows 200000 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import bench_claims  # noqa: E402 - after the path fix above
from bench.claims_external import RESULTS, key_of  # noqa: E402
from bench.common import add_json_option, keep, write_json  # noqa: E402
from node.core.rows import RowWrite  # noqa: E402
from node.store import open_store  # noqa: E402
from node.store.base import WriteBack  # noqa: E402
from node.store.sqlite import SQLiteStore  # noqa: E402


def run(path: Path, mode: str, op: str, per_txn: int, rows: int, seconds: float) -> dict:
    store = open_store(f"sqlite:///{path}")
    assert isinstance(store, SQLiteStore)
    # The bench's one reach inside the store: the mode is a setting of the
    # store's own connection, which every write goes through.
    store._c().execute(f"PRAGMA synchronous = {mode}")
    versions = {}
    txns = items = 0
    i = 0
    t_end = time.perf_counter() + seconds
    t0 = time.perf_counter()
    now = time.time()
    while time.perf_counter() < t_end:
        keys = [key_of((i + j) % rows) for j in range(per_txn)]
        i += per_txn
        if op == "write_back":
            if not versions or keys[0] not in versions:
                versions.update(
                    {k: r.version for k, r in store.get_many(keys).items()}  # type: ignore[union-attr]
                )
            written = store.write_back_many(
                [WriteBack(k, now + 3600, versions[k], i, now) for k in keys]
            )
            for k, v in zip(keys, written, strict=True):
                if v is not None:
                    versions[k] = v
                else:
                    versions.pop(k, None)
        else:
            store.upsert([RowWrite(key=k, route="route00", due_at=now + 60) for k in keys], now=now)
        txns += 1
        items += per_txn
    wall = time.perf_counter() - t0
    store.close()
    return {
        "bench": "sync",
        "synchronous": mode,
        "op": op,
        "per_txn": per_txn,
        "txns_per_s": round(txns / wall, 1),
        "us_per_txn": round(wall / txns * 1e6, 1),
        "us_per_row": round(wall / items * 1e6, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--results", type=Path, default=RESULTS)
    add_json_option(p)
    args = p.parse_args()
    template = bench_claims.template(args.rows, args.results, name="sync", job="j")
    work = Path(tempfile.mkdtemp(prefix="qn-sync-", dir=args.results))
    try:
        for op, sizes in (("write_back", (64, 1)), ("upsert", (100, 1))):
            for per_txn in sizes:
                for mode in ("NORMAL", "FULL"):
                    path = work / f"{mode}.db"
                    shutil.copyfile(template, path)
                    res = run(path, mode, op, per_txn, args.rows, args.seconds)
                    print(json.dumps(keep({**res, "rows": args.rows})))
                    for suffix in ("", "-wal", "-shm"):
                        Path(str(path) + suffix).unlink(missing_ok=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.json)


if __name__ == "__main__":
    main()
