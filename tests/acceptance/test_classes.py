"""``max_classes`` exact at the write through the node (shm/classes.py).

Real nodes: several HTTP workers racing for the last slots, a limit above
the 1,000 classes the state document lists, a keeper killed with kill -9
and a node restarted, and rows written straight into the SQLite file past
the limit. After each, the keeper refused no row written through the node
(``trust.apply.refused_classes``).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from node.testing import NodeProcess, wait_for
from shm.classes import SharedClasses


def _node(tmp_path: Path, max_classes: int, workers: int = 1) -> NodeProcess:
    env = {"QUEUE_NODE_MAX_CLASSES": str(max_classes), "QUEUE_NODE_STATE_INTERVAL_S": "0.2"}
    return NodeProcess(tmp_path, f"t-{uuid.uuid4().hex[:12]}", env=env, workers=workers)


@pytest.fixture
def started(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NodeProcess]:
    max_classes, workers = request.param
    node = _node(tmp_path, max_classes, workers).start()
    try:
        yield node
        assert "Traceback" not in node.log(), node.log()
    finally:
        assert node.stop() == 0, node.log()


def _rows(first: int, n: int, key: str = "k") -> list[dict[str, Any]]:
    """``n`` rows of ``n`` classes of their own: cadence 60 * (first + i) s."""
    return [
        {"key": f"{key}{first + i}", "route": "r", "cadence_s": 60 * (first + i)} for i in range(n)
    ]


def _post(node: NodeProcess, rows: list[dict[str, Any]]) -> tuple[int, Any]:
    return node.request("POST", "/rows", rows, timeout_s=30)


def _state(node: NodeProcess) -> dict[str, Any]:
    status, doc = node.request("GET", "/queue-state")
    assert status in (200, 503), doc
    return doc


def _settled(node: NodeProcess, rows: int) -> dict[str, Any]:
    """The queue state once the keeper vouches for ``rows`` rows."""

    def caught_up() -> dict[str, Any] | None:
        doc = _state(node)
        if doc["trust"]["vouched"] and doc["now"]["rows"] == rows:
            return doc
        return None

    return wait_for(caught_up, 30, f"the keeper holding {rows} rows")


def _refused(doc: dict[str, Any]) -> int:
    return doc["trust"]["apply"]["refused_classes"]


@pytest.mark.parametrize("started", [(40, 3)], indirect=True)
def test_workers_racing_for_the_last_slots_never_pass_the_limit(started: NodeProcess) -> None:
    node = started
    assert _post(node, _rows(1, 30)) == (200, {"upserted": 30})
    # 60 writes of a new class each, at once, over three workers, for the
    # last 10 slots: exactly 10 win, the others are refused and write nothing.
    with ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(lambda i: _post(node, _rows(100 + i, 1, "race")), range(60)))
    won = [a for a in answers if a[0] == 200]
    lost = [a for a in answers if a[0] != 200]
    assert len(won) == 10, answers
    assert {a[0] for a in lost} == {400}
    assert {a[1]["error"]["code"] for a in lost} == {"too_many_classes"}
    doc = _settled(node, 40)
    assert doc["now"]["classes"] == 40
    assert _refused(doc) == 0  # no write answered 200 was refused by the keeper
    with SharedClasses.attach(node.name) as table:
        assert table.used == 40 and len(table.classes()) == 40


@pytest.mark.parametrize("started", [(1_200, 2)], indirect=True)
def test_a_limit_above_a_thousand_is_exact(started: NodeProcess) -> None:
    node = started
    for first in range(1, 1_201, 100):
        assert _post(node, _rows(first, 100)) == (200, {"upserted": 100})
    doc = _settled(node, 1_200)  # the state document lists only 1,000 of them
    assert doc["now"]["classes"] == 1_200 and doc["classes"]["truncated"]
    status, answer = _post(node, _rows(1_201, 1))
    assert (status, answer["error"]["code"]) == (400, "too_many_classes"), answer
    # into a class that exists: always
    assert _post(node, [{"key": "again", "route": "r", "cadence_s": 60 * 1_200}])[0] == 200
    doc = _settled(node, 1_201)
    assert _refused(doc) == 0 and doc["now"]["classes"] == 1_200


def _insert_directly(node: NodeProcess, key: str, cadence_s: int) -> None:
    """Another program writes the SQLite file, past the node."""
    conn = sqlite3.connect(node.data_dir / "schedule.db", timeout=10)
    try:
        with conn:
            conn.execute(
                "INSERT INTO schedule (key, route, cadence_s, sitemap, due_at) "
                "VALUES (?, 'r', ?, 0, ?)",
                (key, cadence_s, time.time()),
            )
    finally:
        conn.close()


def test_keeper_kill_and_node_restart_keep_the_table(tmp_path: Path) -> None:
    node = _node(tmp_path, 20).start()
    try:
        assert _post(node, _rows(1, 20)) == (200, {"upserted": 20})
        _settled(node, 20)
        keeper = node.pids()["keeper"]
        os.kill(keeper, signal.SIGKILL)
        # At once, while no keeper runs and then while the next one loads:
        # the table is whole, so the 21st class is refused from the start.
        status, answer = _post(node, _rows(21, 1))
        assert (status, answer["error"]["code"]) == (400, "too_many_classes"), answer
        wait_for(lambda: node.pids()["keeper"] not in (None, keeper), 30, "a new keeper")
        node.wait_ready()
        status, answer = _post(node, _rows(22, 1))
        assert (status, answer["error"]["code"]) == (400, "too_many_classes"), answer
        assert _post(node, [{"key": "more", "route": "r", "cadence_s": 60}])[0] == 200
        doc = _settled(node, 21)
        assert _refused(doc) == 0 and doc["now"]["classes"] == 20
        with SharedClasses.attach(node.name) as table:
            assert table.used == 20
        # Another program writes a 21st class into the file: the keeper
        # refuses that row and counts it; the node's writes are untouched.
        _insert_directly(node, "outside", 60 * 99)
        wait_for(lambda: _refused(_state(node)) == 1, 30, "the outside row refused")
        assert node.stop() == 0, node.log()
        # A restart builds the table from the store: the 20 classes of the
        # node's rows, in any order the store gives them, and the outside
        # row's class has a slot only if one is left (none here).
        node.start()
        with SharedClasses.attach(node.name) as table:
            assert table.used == 20
        doc = _settled(node, 21)
        assert _refused(doc) == 1 and doc["now"]["classes"] == 20
        assert "Traceback" not in node.log(), node.log()
    finally:
        if not node.exited():
            assert node.stop() == 0, node.log()


def _import(node: NodeProcess, tmp_path: Path, name: str, cadence_s: int) -> int:
    """``python -m node import`` of one row of a class of its own, into the
    running node's store: the exit status."""
    path = tmp_path / f"{name}.jsonl"
    path.write_text(json.dumps({"key": name, "route": "r", "cadence_s": cadence_s}) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "node", "import", str(path),
         "--data-dir", str(node.data_dir), "--name", node.name],
        env=node.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode


@pytest.mark.parametrize("started", [(3, 1)], indirect=True)
def test_the_importer_reserves_in_the_running_node(started: NodeProcess, tmp_path: Path) -> None:
    node = started
    assert _post(node, _rows(1, 2)) == (200, {"upserted": 2})
    assert _import(node, tmp_path, "imported", 60 * 50) == 0  # the third class
    status, answer = _post(node, _rows(3, 1))  # a fourth, at once
    assert (status, answer["error"]["code"]) == (400, "too_many_classes"), answer
    assert _import(node, tmp_path, "refused", 60 * 51) == 2  # nothing imported
    doc = _settled(node, 3)
    assert _refused(doc) == 0 and doc["now"]["classes"] == 3
