"""How long a fleet's rows take to move, and what a held row costs
(issue 18, item 6; docs/fleet.md, "Figures").

``--nodes`` real nodes (``python -m node run``, node/testing.py) over one
PostgreSQL database of ``--rows`` rows. Each repeat times three membership
changes of the last node, from the event until every live keeper says it is
exact over the new live list and their rows add up to the table
(``trust.exact``, ``trust.membership.live`` and ``now.rows`` of each node's
queue state, read from shared memory every 10 ms):

- ``kill``: kill -9 of the node and every process it started; the others
  wait for its membership to lapse (``--membership-timeout-s``), then walk
  the rows they gained;
- ``join``: the node started again on its data directory (a rejoin: its
  keeper loads its share, the others drop it);
- ``leave``: SIGTERM, a clean leave (``left_at``): no timeout to wait for.

After each move the shares are checked row for row once (not timed): every
row held by exactly the node the rendezvous hash names, with the table's due
minute and version. The medians over ``--repeat`` are printed.

Memory: the keeper's USS and RSS (psutil, the ``qn-keeper`` process) once
live, of one node alone holding ``--rows`` rows less the same node holding
none, per row, on PostgreSQL and on SQLite (the default store, its file
seeded before the start).

    .venv/bin/python bench/bench_fleet_moves.py --nodes 3 --rows 100000 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import add_json_option, keep, write_json  # noqa: E402
from node.testing import NodeProcess, finish, wait_for  # noqa: E402
from shm.state import read_state  # noqa: E402
from tests import pg  # noqa: E402

POLL_S = 0.01


def _seed_pg(url: str, rows: int) -> None:
    """``rows`` rows, a third due an hour ago, the rest within a day."""
    now = time.time()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at)"
            " SELECT 'https://example.com/items/' || lpad(i::text, 10, '0'), 'r' || (i %% 7),"
            "        86400, CASE WHEN i %% 3 = 0 THEN %s ELSE %s + i %% 86400 END"
            " FROM generate_series(1, %s) AS i",
            (now - 3600, now + 3600, rows),
        )
        conn.execute("VACUUM ANALYZE schedule")


def _count(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return int(conn.execute("SELECT count(*) FROM schedule").fetchone()[0])


def _settled(nodes: list[NodeProcess], rows: int) -> bool:
    """Every node exact over the live list of exactly ``nodes``, their rows
    adding up to the table's ``rows``."""
    names = sorted(n.name for n in nodes)
    held = 0
    for node in nodes:
        try:
            state = read_state(node.name)
        except Exception:  # noqa: BLE001 - not up yet
            return False
        trust = state.get("trust") or {}
        member = trust.get("membership")  # None: a SQLite node, no fleet
        if not trust.get("exact") or (member is not None and member.get("live") != names):
            return False
        held += (state.get("now") or {}).get("rows") or 0
    return held == rows


def _timed(nodes: list[NodeProcess], rows: int, timeout_s: float, t0: float | None = None) -> float:
    """Seconds from ``t0`` (now) until ``_settled``."""
    t0 = time.monotonic() if t0 is None else t0
    deadline = t0 + timeout_s
    while not _settled(nodes, rows):
        if time.monotonic() > deadline:
            raise AssertionError(f"not settled within {timeout_s} s")
        time.sleep(POLL_S)  # the poll's resolution, not synchronisation
    return time.monotonic() - t0


def _check_shares(nodes: list[NodeProcess], url: str) -> None:
    """Row for row, once the move is timed (tests/acceptance/test_fleet_scale.py)."""
    from tests.acceptance.test_fleet_scale import _exact_shares

    wait_for(lambda: _exact_shares(nodes, url), 120, "exact shares, row for row")


def _keeper_memory(node: NodeProcess) -> tuple[int, int]:
    """(USS, RSS) of the node's qn-keeper process."""
    info = psutil.Process(node.pids()["keeper"]).memory_full_info()
    return int(info.uss), int(info.rss)


def moves(args: argparse.Namespace, env: dict[str, str]) -> dict:
    url = pg.create_database(flush_commits=True)
    base = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    names = sorted(f"b-{uuid.uuid4().hex[:10]}" for _ in range(args.nodes))
    nodes = [NodeProcess(base / n, n, "--store", url, env=env) for n in names]
    timings: dict[str, list[float]] = {"kill": [], "join": [], "leave": []}
    try:
        from node.store.postgres import PostgresStore

        PostgresStore(url).close()
        _seed_pg(url, args.rows)
        rows = _count(url)
        for node in nodes:
            node.start(timeout_s=120)
        _timed(nodes, rows, args.settle_s)
        _check_shares(nodes, url)
        rest, mover = nodes[:-1], nodes[-1]
        for _ in range(args.repeat):
            mover.kill()
            timings["kill"].append(_timed(rest, rows, args.settle_s))
            _check_shares(rest, url)
            t0 = time.monotonic()  # from the command: the node's own start included
            mover.start(timeout_s=120)
            timings["join"].append(_timed(nodes, rows, args.settle_s, t0))
            _check_shares(nodes, url)
            assert mover.proc is not None
            mover.proc.send_signal(signal.SIGTERM)  # a clean leave
            timings["leave"].append(_timed(rest, rows, args.settle_s))
            assert mover.proc.wait(60) == 0
            _check_shares(rest, url)
            mover.start(timeout_s=120)
            _timed(nodes, rows, args.settle_s)
    finally:
        for node in nodes:
            finish([node], node.name)
        pg.drop_database(url)
    return {k: [round(v, 3) for v in vs] for k, vs in timings.items()}


def memory(args: argparse.Namespace, env: dict[str, str], store: str) -> dict:
    """The keeper's memory alone over ``--rows`` rows less over none."""
    out = {}
    for rows in (0, args.rows):
        base = Path(tempfile.mkdtemp(prefix="bench-fleet-mem-"))
        name = f"b-{uuid.uuid4().hex[:10]}"
        url = None
        extra: list[str] = []
        if store == "postgresql":
            url = pg.create_database()
            from node.store.postgres import PostgresStore

            PostgresStore(url).close()
            _seed_pg(url, rows)
            extra = ["--store", url]
        else:
            (base / name).mkdir(parents=True)
            from node.store import open_store

            db = open_store(f"sqlite:///{(base / name).resolve()}/schedule.db")
            db.close()
            _seed_sqlite(base / name / "schedule.db", rows)
        node = NodeProcess(base / name, name, *extra, env=env)
        try:
            node.start(timeout_s=120)
            _timed([node], rows, args.settle_s)
            time.sleep(1.0)  # a publish and a state write after the load: steady, not a sync
            out[rows] = _keeper_memory(node)
            assert node.stop() == 0
        finally:
            finish([node], name)
            if url is not None:
                pg.drop_database(url)
    (uss0, rss0), (uss1, rss1) = out[0], out[args.rows]
    return {
        "store": store,
        "rows": args.rows,
        "keeper_uss_bytes": uss1,
        "keeper_uss_empty_bytes": uss0,
        "uss_bytes_per_row": round((uss1 - uss0) / args.rows, 1),
        "rss_bytes_per_row": round((rss1 - rss0) / args.rows, 1),
    }


def _seed_sqlite(path: Path, rows: int) -> None:
    """The same rows as ``_seed_pg``, in the node's own SQLite file."""
    from node.core.rows import RowWrite
    from node.store import open_store

    now = time.time()
    store = open_store(f"sqlite:///{path.resolve()}")
    try:
        batch: list[RowWrite] = []
        for i in range(1, rows + 1):
            due = now - 3600 if i % 3 == 0 else now + 3600 + i % 86400
            batch.append(RowWrite(f"https://example.com/items/{i:010d}", f"r{i % 7}",
                                  cadence_s=86400, due_at=due))  # fmt: skip
            if len(batch) == 10_000:
                store.upsert(batch, now=now)
                batch = []
        if batch:
            store.upsert(batch, now=now)
        store.trim_changes(store.last_seq())
    finally:
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--membership-timeout-s",
        type=float,
        default=10.0,
        help="the nodes' membership_timeout_s (the node's default: 10)",
    )
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    parser.add_argument(
        "--settle-s", type=float, default=600.0, help="give up on a move after this long"
    )
    parser.add_argument("--skip-moves", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    add_json_option(parser)
    args = parser.parse_args()
    env = {
        "QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": str(args.membership_timeout_s),
        "QUEUE_NODE_HEARTBEAT_S": str(args.heartbeat_s),
        "QUEUE_NODE_STATE_INTERVAL_S": "0.2",  # now.rows follows the moves closely
    }
    setup = {"nodes": args.nodes, "rows": args.rows, "repeat": args.repeat,
             "membership_timeout_s": args.membership_timeout_s,
             "heartbeat_s": args.heartbeat_s}  # fmt: skip
    timings = {} if args.skip_moves else moves(args, env)
    for what, values in timings.items():
        median = round(statistics.median(values), 3)
        line = {"bench": "fleet_moves", "move": what, "median_s": median, "runs_s": values,
                **setup}  # fmt: skip
        print(json.dumps(line), flush=True)
        keep(line)
    if not args.skip_memory:
        for store in ("postgresql", "sqlite"):
            line = {"bench": "fleet_memory", **memory(args, env, store)}
            print(json.dumps(line), flush=True)
            keep(line)
    write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
