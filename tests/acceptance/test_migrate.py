"""``python -m node migrate --from sqlite:///… --to postgresql://…`` (issue 18,
item 4): a node's SQLite schedule moved into PostgreSQL, row for row, with
its meta under its name; a node then started on the database holds every
row. Refusals are one line, exit 2, and leave the target as it was."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest

from node import migrate as node_migrate
from node.core.errors import ConfigError
from node.core.rows import RowWrite
from node.store.base import LastError, WriteBack
from node.store.postgres import PostgresStore
from node.store.sqlite import SQLiteStore
from node.testing import ROOT, NodeProcess, finish, wait_for
from tests import pg

pytestmark = pytest.mark.timeout(120)

ROWS = 3_000
PAUSED_ROUTE = "paused-route"
COLUMNS = (
    "key, route, cadence_s, sitemap, due_at, payload, job,"
    " last_result_id, last_finished_at, last_error"
)
PAYLOADS = (None, {"a": [1, 2, {"b": None}]}, [1, "x"], "text ü ☃", 3.5, True, "p" * 10_000)


def migrate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node", "migrate", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
        env=dict(os.environ, **(env or {})),
    )  # fmt: skip


def seed(path: Path, n: int = ROWS, prefix: str = "k") -> None:
    """A node's store with varied rows: every route, cadence (its own or
    the route's), sitemap flag, payload shape, job; due long ago or days
    ahead (so no row comes due while the test runs); some with a result
    written back, some with a last error; one written by another program
    (a payload that is not JSON)."""
    now = time.time()
    routes = ("pages", "feeds", PAUSED_ROUTE, "other")
    store = SQLiteStore(path)
    writes = [
        RowWrite(
            f"{prefix}{i:05d}" + ("/ü ☃" if i % 97 == 0 else ""),
            routes[i % 4],
            cadence_s=None if i % 3 == 0 else (60, 3600, 86_400, 604_800)[i % 4],
            sitemap=i % 5 == 0,
            due_at=now - 7200 - i if i % 2 else now + 3 * 86_400 + i,
            payload=PAYLOADS[i % len(PAYLOADS)],
            job=("default", "embed", "render:v2")[i % 3],
        )
        for i in range(n)
    ]
    writes.append(RowWrite(prefix + "x" * 1000, "pages"))  # a long key, every default
    store.upsert(writes, now=now)
    rows = store.get_many([w.key for w in writes[: n // 10]])
    store.write_back_many([
        WriteBack(key, now + 86_400 + 0.25, row.version, 1000 + j, now - j)
        for j, (key, row) in enumerate(sorted(rows.items()))
    ])  # fmt: skip
    store.write_last_errors(
        [LastError(w.key, f"oom {i}", now) for i, w in enumerate(writes[-50:-1])]
    )
    store.set_meta("paused_node", False)  # a node that never ran has this much meta
    store.close()
    with sqlite3.connect(path) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, sitemap, due_at, payload) VALUES (?, ?, 0, ?, ?)",
            (prefix + "-outside", "pages", now - 600.5, "{not json"),
        )


def sqlite_rows(path: Path) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute(f"SELECT {COLUMNS} FROM schedule ORDER BY key").fetchall()


def pg_rows(url: str) -> list[tuple]:
    with psycopg.connect(url) as conn:
        return conn.execute(f"SELECT {COLUMNS} FROM schedule ORDER BY key").fetchall()


def snapshot(url: str) -> tuple:
    """What a refused run must leave as it was: the rows, the log's top, the meta."""
    with psycopg.connect(url) as conn:
        if not conn.execute("SELECT to_regclass('schedule') IS NOT NULL").fetchone()[0]:
            return ()
        return (
            conn.execute(f"SELECT {COLUMNS}, version FROM schedule ORDER BY key").fetchall(),
            conn.execute("SELECT last_value, is_called FROM changes_seq").fetchone(),
            conn.execute("SELECT * FROM node_meta ORDER BY node, name").fetchall(),
        )


def refused(result: subprocess.CompletedProcess, words: str) -> None:
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert words in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def queue_state(node: NodeProcess) -> dict:
    def vouched() -> dict | None:
        status, body = node.request("GET", "/queue-state")
        return body if status == 200 and body["trust"]["vouched"] else None

    return wait_for(vouched, 60, "the keeper vouching")


@pytest.fixture
def target(pg_url: str) -> str:
    PostgresStore(pg_url).close()  # the schema, in a database new to this run
    pg.reset(pg_url)
    return pg_url


def test_a_stopped_nodes_schedule_moves_row_for_row_and_a_node_on_postgresql_holds_it(
    tmp_path: Path, node_name: str, target: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    db = data / "schedule.db"
    seed(db)
    source = f"sqlite:///{db}"
    node = NodeProcess(data, node_name)
    fleet_node = NodeProcess(data, node_name, "--store", target)
    try:
        node.start()
        assert node.request("POST", "/admin/pause", {"route": PAUSED_ROUTE})[0] == 200
        # A lease a GPU holds over the stop (saved in the data directory).
        status, body = node.request("POST", "/claim", {"max": 1, "consumer": "gpu", "lease_s": 600})
        assert status == 200 and len(body["leases"]) == 1, body
        wait_for(lambda: queue_state(node)["now"]["paused"]["routes"] == [PAUSED_ROUTE], 30,
                 "the pause in the state")  # fmt: skip
        before = queue_state(node)
        # While the node runs, its store is not moved.
        refused(migrate("--from", source, "--to", target), "runs on")
        assert snapshot(target)[0] == []
        assert node.stop() == 0

        expected = sqlite_rows(db)
        with sqlite3.connect(db) as conn:
            meta = dict(conn.execute("SELECT name, value FROM meta").fetchall())
        done = migrate("--from", source, "--to", target, "--progress-s", "0")
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["migrated"] == len(expected) == ROWS + 2
        assert summary["node"] == node_name  # the data directory's last run on this file
        assert summary["uncounted_changes"] == 0  # a clean stop: the keeper had counted all
        assert summary["leases_outstanding"] == 1  # its row runs once more (docs/postgres.md)
        assert f"{len(expected):,} of {len(expected):,} rows" in done.stderr  # progress

        assert pg_rows(target) == expected  # every column but the version, row for row
        with psycopg.connect(target) as conn:
            moved = dict(conn.execute(
                "SELECT name, value FROM node_meta WHERE node = %s", (node_name,)
            ).fetchall())  # fmt: skip
            top = conn.execute("SELECT MAX(seq) FROM changes").fetchone()[0]
            fleet = dict(conn.execute(
                "SELECT name, value FROM node_meta WHERE node = ''"
            ).fetchall())  # fmt: skip
        # The paused routes are the fleet's (docs/fleet.md, "Pausing").
        assert set(moved) | set(fleet) == set(meta) >= {"paused_routes", "received"}
        assert json.loads(fleet["paused_routes"]) == [PAUSED_ROUTE]
        assert moved["keeper_counts"] == meta["keeper_counts"]
        received = json.loads(meta["received"])
        assert json.loads(moved["received"]) == {**received, "seq": top}

        fleet_node.start()
        after = queue_state(fleet_node)
        assert after["now"]["due"] == before["now"]["due"]
        assert after["now"]["due"]["total"] > ROWS // 3
        assert after["now"]["paused"]["routes"] == [PAUSED_ROUTE]
        assert after["counters"]["received"] == before["counters"]["received"]
        for key, payload in (
            ("k00001", PAYLOADS[1]),
            ("k00000/ü ☃", None),
            ("k00006", PAYLOADS[6]),
            ("k-outside", "{not json"),
        ):
            status, body = fleet_node.request("GET", f"/rows?key={quote(key)}")
            assert status == 200 and body["row"]["payload"] == payload, body
        assert fleet_node.stop() == 0
    finally:
        finish([node, fleet_node], node_name)


def test_refusals_are_one_line_and_leave_the_target_as_it_was(tmp_path: Path, target: str) -> None:
    db = tmp_path / "schedule.db"
    seed(db, 300)
    source = f"sqlite:///{db}"
    other = PostgresStore(target, node_name="other")
    other.upsert([RowWrite("theirs", "pages")], now=time.time())
    other.close()
    before = snapshot(target)

    refused(migrate("--from", target, "--to", target), "--from must be a SQLite store")
    refused(migrate("--from", f"sqlite:///{tmp_path}/gone.db", "--to", target), "no such file")
    refused(migrate("--from", source, "--to", source), "--to must be a PostgreSQL store")
    refused(migrate("--from", source, "--to", target), "holds rows already")
    # A node.json naming a live pid: a node runs on the file's data directory.
    (tmp_path / "node.json").write_text(json.dumps({"pid": os.getpid()}))
    refused(migrate("--from", source, "--to", target, "--merge"), "runs on")
    (tmp_path / "node.json").unlink()
    # A value PostgreSQL's column cannot hold, in the last row by key: found
    # before anything is written (not even a seq taken).
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO schedule (key, route, cadence_s, due_at) "
                     "VALUES ('zz', 'pages', 'hourly', 0)")  # fmt: skip
    refused(migrate("--from", source, "--to", target, "--merge", "--name", "n1"),
            "row 'zz': cadence_s holds 'hourly'")  # fmt: skip
    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM schedule WHERE key = 'zz'")
    assert snapshot(target) == before

    # --merge: another node's rows stay; the password is never shown.
    secret = target.replace("postgres@", "postgres:s3cr3t-pw@", 1)
    done = migrate("--from", source, "--to", secret, "--merge", "--name", "n1")
    assert done.returncode == 0, done.stderr
    assert "s3cr3t-pw" not in done.stdout + done.stderr
    assert json.loads(done.stdout)["to"] == target  # the password went to PGPASSWORD
    assert [r[0] for r in pg_rows(target)] == sorted([*(r[0] for r in sqlite_rows(db)), "theirs"])

    # Again: every key is there now, and the name has its meta.
    merged = snapshot(target)
    refused(migrate("--from", source, "--to", target, "--merge", "--name", "n2"),
            "holds key 'k-outside' already")  # fmt: skip
    refused(migrate("--from", source, "--to", target, "--merge", "--name", "n1"),
            "holds meta of node 'n1' already")  # fmt: skip
    assert snapshot(target) == merged


def test_statements_are_cut_by_payload_bytes_too(
    tmp_path: Path, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "schedule.db"
    seed(db, 300)
    monkeypatch.setattr(node_migrate, "CHUNK_BYTES", 50_000)  # a 10 KB payload every 7th row
    the_plan = node_migrate.plan(f"sqlite:///{db}", target, name="n1", data_dir=None, merge=False)
    the_plan.progress_every_s = 0.0
    lines: list[str] = []
    summary = node_migrate.run(the_plan, lines.append)
    assert summary.rows == 302
    assert len(lines) >= 8  # one a statement: 43 payloads of 10 KB, 5 a statement
    assert pg_rows(target) == sqlite_rows(db)


def test_a_write_to_the_source_during_the_copy_commits_nothing(tmp_path: Path, target: str) -> None:
    db = tmp_path / "schedule.db"
    seed(db, 300)
    before = snapshot(target)
    the_plan = node_migrate.plan(f"sqlite:///{db}", target, name="n1", data_dir=None, merge=False)
    the_plan.progress_every_s = 0.0  # a progress line after every statement: the write goes there

    def write_meanwhile(_line: str) -> None:
        store = SQLiteStore(db)
        store.upsert([RowWrite("late", "pages")], now=time.time())
        store.close()

    with pytest.raises(ConfigError, match="was written while it was copied"):
        node_migrate.run(the_plan, write_meanwhile)
    after = snapshot(target)
    assert (after[0], after[2]) == (before[0], before[2]) == ([], [])  # no row, no meta
