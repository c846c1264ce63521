"""A store that existed and is gone is never made anew (node/store/made.py).

The store lives in a directory of its own, taken away as an unmounted volume
would be (renamed). Before the rule, a keeper restarted meanwhile (kill -9)
opened the path with "create" and served a new, empty schedule.db; when the
volume came back it could not even be put back under its name. Now the
restarted keeper waits for the store, saying ``unreachable`` in
``trust.store``, and serves the real rows once it is back, none lost; and a
node started while it is away is refused (exit 2, one line) instead of
starting empty.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from node.testing import NodeProcess, finish, wait_for

ENV = {
    "QUEUE_NODE_STATE_INTERVAL_S": "0.5",  # queue-state follows within a second
    "QUEUE_NODE_VERIFY_INTERVAL_S": "3600",  # no scheduled walk
}


def _rows(prefix: str, n: int) -> list[dict[str, Any]]:
    due_at = time.time() - 600
    return [{"key": f"{prefix}{i:04d}", "route": "r", "due_at": due_at} for i in range(n)]


def _write(node: NodeProcess, rows: list[dict[str, Any]]) -> None:
    status, body = node.request("POST", "/rows", rows)
    assert status == 200, body


def _state(node: NodeProcess) -> tuple[int, dict[str, Any]]:
    status, doc = node.request("GET", "/queue-state")
    assert status in (200, 503), (status, doc)
    return status, doc


def _vouched_with(node: NodeProcess, rows: int) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        status, doc = _state(node)
        return doc if status == 200 and doc["now"]["rows"] == rows else None

    return wait_for(check, 30, f"queue-state 200 with {rows} rows")


def _node(tmp_path: Path, node_name: str) -> tuple[NodeProcess, Path]:
    volume = tmp_path / "volume"
    volume.mkdir(exist_ok=True)
    db = volume / "schedule.db"
    return NodeProcess(tmp_path / "data", node_name, "--store", f"sqlite:///{db}", env=ENV), volume


@pytest.mark.timeout(120)
def test_a_keeper_restarted_while_the_store_is_away_waits_for_it(
    tmp_path: Path, node_name: str
) -> None:
    node, volume = _node(tmp_path, node_name)
    away = tmp_path / "volume.away"
    try:
        node.start()
        _write(node, _rows("k", 200))
        _vouched_with(node, 200)
        os.rename(volume, away)
        try:
            old = node.pids()["keeper"]
            os.kill(old, signal.SIGKILL)
            wait_for(lambda: node.pids().get("keeper") not in (None, old), 20, "a new keeper")

            def waiting() -> dict[str, Any] | None:
                trust = _state(node)[1]["trust"]
                phase = trust.get("phase") or ""
                waits = phase.startswith("store unreachable") and trust["status"] == "loading"
                return trust if waits and trust["store"].get("attempts", 0) >= 3 else None

            trust = wait_for(waiting, 20, "the new keeper waiting for its store")
            assert trust["vouched"] is False and trust["live"] is True, trust
            assert trust["store"]["state"] == "unreachable", trust
            assert "schedule.db" in trust["store"]["error"], trust
            assert not volume.exists(), "a restarted keeper made the store anew"
            # Writes go on meanwhile: the workers' connections hold the file.
            _write(node, _rows("meanwhile", 30))
        finally:
            os.rename(away, volume)
        doc = _vouched_with(node, 230)
        assert doc["trust"]["store"]["state"] == "ok", doc["trust"]
        status, body = node.request("POST", "/claim", {"max": 1000, "consumer": "t"})
        assert status == 200 and len(body["leases"]) == 230, (status, len(body.get("leases", [])))
        assert "keeper_store_missing_at_start" in node.log()
        assert node.stop() == 0
    finally:
        finish([node], node_name)


@pytest.mark.timeout(120)
def test_a_node_started_while_its_store_is_away_is_refused(tmp_path: Path, node_name: str) -> None:
    node, volume = _node(tmp_path, node_name)
    away = tmp_path / "volume.away"
    try:
        node.start()
        _write(node, _rows("k", 50))
        _vouched_with(node, 50)
        assert node.stop() == 0
        os.rename(volume, away)
        try:
            refused = subprocess.run(node.argv(), env=node.env, cwd=node.cwd,
                                     capture_output=True, text=True, timeout=20)  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail("the node started (on a new, empty store) instead of refusing")
        assert refused.returncode == 2, refused.stderr
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "is gone" in lines[0] and "store.json" in lines[0], lines
        assert not volume.exists(), "a start made the store anew"
        assert (tmp_path / "data" / "store.json").exists()
        os.rename(away, volume)
        node.start()
        _vouched_with(node, 50)
        assert node.stop() == 0
    finally:
        finish([node], node_name)


@pytest.mark.timeout(120)
def test_an_import_does_not_make_a_gone_store_anew(tmp_path: Path, node_name: str) -> None:
    """``python -m node import --data-dir`` follows the data directory's rule:
    it makes the store of a new directory, never one that was made and is gone."""
    data = tmp_path / "data"
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"key": "imported", "route": "r"}\n')
    argv = [sys.executable, "-m", "node", "import", str(rows), "--data-dir", str(data)]

    def run_import() -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)

    assert run_import().returncode == 0  # a new data directory: the import makes it
    node = NodeProcess(data, node_name, env=ENV)
    try:
        node.start()  # finds the store: store.json says so from now on
        _vouched_with(node, 1)
        assert node.stop() == 0
    finally:
        finish([node], node_name)
    for suffix in ("", "-wal", "-shm"):
        (data / f"schedule.db{suffix}").unlink(missing_ok=True)
    refused = run_import()
    assert refused.returncode == 2 and "is gone" in refused.stderr, refused.stderr
    assert not (data / "schedule.db").exists(), "an import made the store anew"

