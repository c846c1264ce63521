"""Acceptance: ``scripts/fleet`` (issue 19, item 4; docs/fleet.md, "Running a
fleet on one host"). ``start 2`` creates the fleet's database, runs two nodes
detached, each waiting for the other, and prints their URLs once both are
ready; ``status`` shows both ready and vouched and the cluster's state; a
second ``start`` is refused; ``stop`` ends every process of both nodes and
leaves their data directories.

The script's module is run with this interpreter (``scripts/fleet`` only
execs ``.venv/bin/python -m node.fleetctl``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from node.testing import ROOT, cleanup_segments, wait_for
from tests import pg

pytestmark = pytest.mark.timeout(120)

# Small membership timeouts: the joining node's handover hold is one timeout.
FLEET_ENV = {"QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": "4", "QUEUE_NODE_HEARTBEAT_S": "0.2"}


def _fleet(*args: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUEUE_NODE_")}
    return subprocess.run(
        [sys.executable, "-m", "node.fleetctl", *args], cwd=ROOT, env={**env, **FLEET_ENV},
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def _status(common: list[str]) -> dict:
    out = _fleet("status", *common, "--json")
    assert out.returncode in (0, 3), out.stdout + out.stderr  # 3: the cluster's state is 503
    return json.loads(out.stdout)


def _vouched(doc: dict) -> bool:
    return doc["cluster"]["status"] == 200 and all(n["vouched"] for n in doc["nodes"])


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _all_pids(data_dir: Path) -> list[int]:
    """The supervisor's and every child's pid, from the node's node.json."""
    doc = json.loads((data_dir / "node.json").read_text())
    pids = doc["pids"]
    singles = [pids.get(role) for role in ("keeper", "ledger", "rows")]
    return [doc["pid"], *[p for p in singles if p], *pids["workers"], *pids["inference"]]


def test_fleet_start_status_stop_runs_two_nodes_as_one_and_leaves_nothing_running(tmp_path):
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    names = [f"{prefix}-1", f"{prefix}-2"]
    db = f"{pg.SERVER}/queue_node_test_fleet_{uuid.uuid4().hex[:8]}"
    fleet_dir = tmp_path / "fleet"
    common = ["--dir", str(fleet_dir)]
    pids: list[int] = []
    try:
        out = _fleet("start", "2", *common, "--db", db, "--base-port", "0", "--prefix", prefix,
                     "--wait-s", "60", "--workers", "1")  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith("created the database"), lines
        urls = dict(line.split() for line in lines[1:])
        assert list(urls) == names and all(u.startswith("http://127.0.0.1:") for u in urls.values())
        for name in names:
            pids += _all_pids(fleet_dir / name)
        assert len(pids) >= 2 * 4  # supervisor, keeper, ledger, rows, a worker: each node

        doc = _status(common)
        assert [n["name"] for n in doc["nodes"]] == names
        for node in doc["nodes"]:
            assert node["url"] == urls[node["name"]]
            assert node["alive"] and node["readyz"] == 200, node
        # Ready is not yet vouched: a node whose keeper walked in the rows of
        # a membership change vouches from its next count (state_interval_s).
        doc = wait_for(lambda: _vouched(d := _status(common)) and d, 20, "vouched")
        for node in doc["nodes"]:
            assert node["due"] == 0 and node["in_flight"] == 0, node
        assert doc["cluster"]["asked"] == names[0]
        text = _fleet("status", *common)
        assert text.returncode == 0 and "cluster (asked" in text.stdout, text.stdout

        again = _fleet("start", "2", *common, "--db", db, "--base-port", "0", "--prefix", prefix)
        assert again.returncode == 2 and again.stdout == "", again
        assert len(again.stderr.splitlines()) == 1 and "has nodes running" in again.stderr

        out = _fleet("stop", *common)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.splitlines() == [f"{n} stopped" for n in names]
        assert [p for p in pids if _running(p)] == []
        for name in names:  # durable state stays; the node's own record of running goes
            assert (fleet_dir / name / "node.log").exists()
            assert not (fleet_dir / name / "node.json").exists()
        out = _fleet("status", *common, "--json")
        assert out.returncode == 4
        assert [n["alive"] for n in json.loads(out.stdout)["nodes"]] == [False, False]
    finally:
        for pid in pids:
            if _running(pid):
                psutil.Process(pid).kill()
        for name in names:
            cleanup_segments(name)
        pg.drop_database(db)
