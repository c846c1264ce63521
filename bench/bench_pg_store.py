"""The PostgreSQL store against SQLite, in one run (issue 18, item 1).

Three operations the node runs, on each store in turn (alternated, each
repeated; the median is printed):

- bulk upsert: ``--rows`` new rows in batches of ``--batch`` (an import, a
  producer's POST /rows), rows/s;
- the ledger's write-back: ``write_back_many`` of 64 rows a group under the
  version guard, µs a row, on a store opened as the ledger opens it (not
  durable: SQLite NORMAL, PostgreSQL ``synchronous_commit = off``, with
  ``sync`` before acks) and on a durable one;
- the keeper's feed: ``changes(after, 1000)`` over the whole log, µs a change.

PostgreSQL is a database of its own on ``--server`` (created, dropped at the
end); SQLite is a file in a temporary directory (``synchronous = FULL``, as
the node opens it). One JSON line per store (``--json PATH``: the lines as
one list, for ``python -m bench``).

    .venv/bin/python bench/bench_pg_store.py --rows 50000 --repeat 3
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
from bench.common import add_json_option, keep, write_json  # noqa: E402
from node.core.rows import RowWrite  # noqa: E402
from node.store.base import Store, WriteBack  # noqa: E402
from node.store.postgres import PostgresStore  # noqa: E402
from node.store.sqlite import SQLiteStore  # noqa: E402
from tests import pg  # noqa: E402

GROUP = 64


def _upsert(store: Store, rows: int, batch: int) -> float:
    """Bulk upsert of ``rows`` new rows; rows/s."""
    now = time.time()
    writes = [
        RowWrite(f"k{i:08d}", "pages", cadence_s=3600, due_at=now + i % 3600,
                 payload={"url": f"https://example.com/{i}"})
        for i in range(rows)
    ]  # fmt: skip
    t0 = time.perf_counter()
    for i in range(0, rows, batch):
        store.upsert(writes[i : i + batch], now=now)
    return rows / (time.perf_counter() - t0)


def _write_back(store: Store, rows: int, groups: int) -> float:
    """``groups`` write-backs of GROUP rows; µs a row."""
    keys = [f"k{i:08d}" for i in range(0, min(rows, groups * GROUP))]
    versions = {k: r.version for k, r in store.get_many(keys).items()}
    spent = 0.0
    for g in range(groups):
        group = keys[(g * GROUP) % len(keys) :][:GROUP]
        items = [WriteBack(k, time.time() + 3600, versions[k], g, time.time()) for k in group]
        t0 = time.perf_counter()
        got = store.write_back_many(items)
        spent += time.perf_counter() - t0
        for k, v in zip(group, got, strict=True):
            assert v is not None, k
            versions[k] = v
    return spent / (groups * GROUP) * 1e6


def _feed(store: Store) -> float:
    """The whole change log read by changes(after, 1000); µs a change."""
    after, n = 0, 0
    t0 = time.perf_counter()
    while page := store.changes(after, 1000):
        n += len(page)
        after = page[-1].seq
    return (time.perf_counter() - t0) / max(n, 1) * 1e6


def _once(store: Store, ledgers: Store, args: argparse.Namespace) -> dict[str, float]:
    """``store`` opened durable (as the node's writers), ``ledgers`` not (as
    the ledger opens its own: its commits do not wait for a flush)."""
    return {
        "upsert_rows_per_s": _upsert(store, args.rows, args.batch),
        "write_back_us_per_row": _write_back(ledgers, args.rows, args.groups),
        "write_back_durable_us_per_row": _write_back(store, args.rows, args.groups),
        "changes_us_per_change": _feed(store),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=5_000)
    parser.add_argument("--groups", type=int, default=200, help="write-back groups of 64")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--server", default=pg.SERVER)
    add_json_option(parser)
    args = parser.parse_args()
    pg.SERVER = args.server
    url = pg.create_database(flush_commits=True)
    results: dict[str, list[dict[str, float]]] = {"sqlite": [], "postgresql": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n in range(args.repeat):
                path = Path(tmp) / f"s{n}.db"
                sqlite = SQLiteStore(path)
                sqlite_ledgers = SQLiteStore(path, durable=False, autocheckpoint=False)
                try:
                    results["sqlite"].append(_once(sqlite, sqlite_ledgers, args))
                finally:
                    sqlite_ledgers.close()
                    sqlite.close()
                pg.reset(url)
                postgres = PostgresStore(url)
                postgres_ledgers = PostgresStore(url, durable=False)
                try:
                    results["postgresql"].append(_once(postgres, postgres_ledgers, args))
                finally:
                    postgres_ledgers.close()
                    postgres.close()
    finally:
        pg.drop_database(url)
    for store, runs in results.items():
        line = {"store": store, "rows": args.rows, "batch": args.batch, "group": GROUP}
        for name in runs[0]:
            line[name] = round(statistics.median(r[name] for r in runs), 2)
        print(json.dumps(keep(line)))
    write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
