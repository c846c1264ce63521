"""What the ledger's write-back of a group costs in SQLite, on a copy of the
whole cycle's template (bench/bench_cycle.py): groups of ``--group`` rows
whose keys are scattered over the table, as a group's completions are, each
read first (the ledger's intake reads every item's row: ``Store.jobs_of``),
then written back in one transaction as ``SQLiteStore.write_back_many``
writes it: BEGIN, the origin set, one ``executemany`` of the guarded UPDATE,
COMMIT. The process's CPU (not wall time) of each part, p50 over
``--groups`` groups, the WAL checkpointed every 50 groups (the ledger's
checkpoint runs on a thread of its own and is not counted).

Two ways, each on a fresh copy: ``as-is`` (the change log's triggers as the
schema has them), and ``no-triggers`` (``schedule_log_update`` and
``schedule_version_guard`` dropped from the copy: what logging the change
and setting the row's version cost; a node never runs so).

    .venv/bin/python bench/bench_write_back.py --rows 400000 --groups 400
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_cycle import template  # noqa: E402 - after the path fix above
from bench.common import add_json_option, keep, percentile, write_json  # noqa: E402
from node.core.rows import ORIGIN_WRITEBACK  # noqa: E402
from node.store import queries as q  # noqa: E402
from node.store.sqlite import SQLiteStore  # noqa: E402

WAYS = ("as-is", "no-triggers")
CHECKPOINT_EVERY = 50  # groups


def measure(db: Path, way: str, groups: int, group: int) -> dict:
    store = SQLiteStore(db, durable=False, autocheckpoint=False)
    conn = store._c()
    if way == "no-triggers":
        conn.execute("DROP TRIGGER schedule_log_update")
        conn.execute("DROP TRIGGER schedule_version_guard")
    version = dict(conn.execute("SELECT key, version FROM schedule").fetchall())
    keys = list(version)
    if len(keys) < groups * group:
        raise SystemExit(f"{len(keys)} rows: --groups {groups} of {group} need more")
    random.Random(1).shuffle(keys)
    parts: dict[str, list[float]] = {"begin": [], "statement": [], "commit": []}
    now = time.time()
    for g in range(groups):
        batch = keys[g * group : (g + 1) * group]
        store.jobs_of(batch)  # the intake's read: the rows' pages in the cache
        params = [
            (now + 3600, 10**9 + g * group + i, now, key, version[key])
            for i, key in enumerate(batch)
        ]
        t0 = time.process_time()
        conn.execute(q.BEGIN_WRITE)
        conn.execute(q.SET_ORIGIN, (ORIGIN_WRITEBACK,))
        seq = conn.execute(q.LAST_SEQ).fetchone()[0]
        t1 = time.process_time()
        written = conn.executemany(q.WRITE_BACK, params).rowcount
        t2 = time.process_time()
        conn.execute(q.RESET_ORIGIN)
        conn.execute(q.COMMIT)
        t3 = time.process_time()
        if written != group:
            raise SystemExit(f"group {g}: {written} of {group} rows written back")
        parts["begin"].append(t1 - t0)
        parts["statement"].append(t2 - t1)
        parts["commit"].append(t3 - t2)
        if way == "as-is":  # each row's new version: the seq its change took
            for n, key in enumerate(batch, seq + 1):
                version[key] = n
        if g % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1:
            store.checkpoint_wal()
    store.close()
    p50 = {name: (percentile(sorted(values), 0.5) or 0.0) * 1e3 for name, values in parts.items()}
    total = sum(p50.values())
    return {
        "way": way,
        "group": group,
        "groups": groups,
        **{f"{name}_ms": round(ms, 3) for name, ms in p50.items()},
        "total_ms": round(total, 3),
        "us_a_row": round(total * 1e3 / group, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--groups", type=int, default=400)
    parser.add_argument("--group", type=int, default=64, help="rows a write-back transaction")
    parser.add_argument("--repeat", type=int, default=2, help="rounds, the ways alternated")
    add_json_option(parser)
    args = parser.parse_args(argv)
    source = template(args.rows, scattered=True)
    print(f"template {source}; CPU a group, p50 (ms)")
    with tempfile.TemporaryDirectory(prefix="qn-wb-") as tmp:
        for round_ in range(args.repeat):
            for way in WAYS:
                db = Path(tmp) / f"{way}.db"
                shutil.copyfile(source, db)
                res = keep({**measure(db, way, args.groups, args.group), "round": round_})
                print(
                    f"{way:<12} begin {res['begin_ms']:.3f}  statement {res['statement_ms']:.3f}"
                    f"  commit {res['commit_ms']:.3f}  = {res['total_ms']:.3f} ms,"
                    f" {res['us_a_row']:.1f} us a row"
                )
                for path in Path(tmp).glob(f"{way}.db*"):
                    path.unlink()
    write_json(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
