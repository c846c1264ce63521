"""``python -m node migrate`` against the PostgreSQL store's own bulk upsert,
in one run (issue 18, item 4).

A SQLite store of ``--rows`` rows (made once, as a node's), then, alternated
and repeated (the median is printed), each into a new database of its own on
the test server:

- migrate: ``node.migrate.run``, the whole run (the schema, the copy in one
  transaction, the read-back and its checksum, the meta), rows/s;
- upsert: the same rows through ``PostgresStore.upsert`` in batches of 5,000
  (what ``python -m node import`` does), rows/s.

    .venv/bin/python bench/bench_migrate.py --rows 100000 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from node import migrate  # noqa: E402
from node.core.rows import RowWrite  # noqa: E402
from node.store.postgres import PostgresStore  # noqa: E402
from node.store.sqlite import SQLiteStore  # noqa: E402
from tests import pg  # noqa: E402

BATCH = 5_000


def _writes(rows: int) -> list[RowWrite]:
    now = time.time()
    return [
        RowWrite(f"k{i:08d}", "pages", cadence_s=3600, due_at=now + i % 3600,
                 payload={"url": f"https://example.com/{i}"})
        for i in range(rows)
    ]  # fmt: skip


def _migrate(db: Path, rows: int) -> float:
    url = pg.create_database(flush_commits=True)
    try:
        plan = migrate.plan(f"sqlite:///{db}", url, name="bench", data_dir=None, merge=False)
        plan.progress_every_s = 3600.0
        t0 = time.perf_counter()
        summary = migrate.run(plan, print)
        spent = time.perf_counter() - t0
        assert summary.rows == rows
        return rows / spent
    finally:
        pg.drop_database(url)


def _upsert(writes: list[RowWrite]) -> float:
    url = pg.create_database(flush_commits=True)
    try:
        store = PostgresStore(url)
        now = time.time()
        t0 = time.perf_counter()
        for i in range(0, len(writes), BATCH):
            store.upsert(writes[i : i + BATCH], now=now)
        spent = time.perf_counter() - t0
        store.close()
        return len(writes) / spent
    finally:
        pg.drop_database(url)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    writes = _writes(args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "schedule.db"
        store = SQLiteStore(db)
        for i in range(0, len(writes), BATCH):
            store.upsert(writes[i : i + BATCH], now=time.time())
        store.close()
        runs: dict[str, list[float]] = {"migrate": [], "upsert": []}
        for _ in range(args.repeat):
            runs["migrate"].append(_migrate(db, args.rows))
            runs["upsert"].append(_upsert(writes))
    print(json.dumps({
        "rows": args.rows,
        "repeat": args.repeat,
        "migrate_rows_per_s": round(statistics.median(runs["migrate"])),
        "upsert_rows_per_s": round(statistics.median(runs["upsert"])),
        "runs": {k: [round(v) for v in vs] for k, vs in runs.items()},
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
