"""Acceptance: ``python -m node`` as a subprocess, real signals, real kill -9."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import psutil
import pytest

from node.testing import ROOT, NodeProcess, finish, wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def node(tmp_path, node_name):
    proc = NodeProcess(tmp_path / "data", node_name)
    yield proc
    finish([proc], node_name)


def _state(name: str) -> dict:
    from shm.state import read_state

    return read_state(name)


def _vouched(name: str):
    try:
        state = _state(name)
    except Exception:  # noqa: BLE001 - not up yet
        return False
    return state if state["trust"]["vouched"] else False


def _dump(node: NodeProcess) -> dict[str, int]:
    """The keeper's buckets as key -> version, through the ask channel."""
    from keeper.ask import ask

    reply = wait_for(lambda: ask(node.name, {"op": "dump"}, timeout_s=2), 30, "keeper dump")
    assert reply["ok"], reply
    path = Path(reply["path"])
    assert path.parent == (node.data_dir / "run").resolve()
    doc = msgpack.unpackb(path.read_bytes())
    return {key: version for key, _minute, _cid, version in doc["rows"]}


def _table(node: NodeProcess) -> dict[str, int]:
    conn = sqlite3.connect(node.data_dir / "schedule.db")
    try:
        return dict(conn.execute("SELECT key, version FROM schedule"))
    finally:
        conn.close()


def _wait_exact(node: NodeProcess, timeout_s: float = 30) -> None:
    def same():
        return _dump(node) == _table(node)
    wait_for(same, timeout_s, "keeper equal to the table")


def test_run_write_state_and_clean_stop(node):
    node.start()
    info = node.node_json()
    assert info["name"] == node.name
    assert info["pids"]["keeper"] and len(info["pids"]["workers"]) == 1
    now = time.time()
    rows = [{"key": f"item-{i}", "route": "pages", "due_at": now - 120, "sitemap": i % 3 == 0}
            for i in range(300)]
    status, body = node.request("POST", "/rows", rows)
    assert (status, body) == (200, {"upserted": 300})
    # An outside program writes the file directly.
    conn = sqlite3.connect(node.data_dir / "schedule.db")
    with conn:
        conn.execute("INSERT INTO schedule (key, route, due_at) VALUES ('outside', 'x', ?)",
                     (now - 60,))
    conn.close()
    _wait_exact(node)

    def counted():
        state = _vouched(node.name)
        return state if state and state["now"]["due"]["total"] == 301 else False
    state = wait_for(counted, 20, "state buffer counting 301 due")
    assert state["now"]["due"] == {"sitemap": 100, "discovered": 201, "total": 301}

    out = subprocess.run([sys.executable, "-m", "node", "state", "--name", node.name],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["now"]["due"]["total"] == 301

    status, body = node.request("GET", "/rows?key=item-7")
    assert status == 200
    assert body["row"]["key"] == "item-7"
    assert body["keeper"]["held"] is True

    pids = [node.proc.pid, info["pids"]["keeper"], *info["pids"]["workers"]]
    assert node.stop() == 0
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    assert not (node.data_dir / "node.json").exists()
    out = subprocess.run([sys.executable, "-m", "node", "state", "--name", node.name],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 4, out


def test_kill_keeper_restarts_and_readers_keep_the_last_set(node):
    from shm.ready import ReadySet

    node.start()
    now = time.time()
    node.request("POST", "/rows", [{"key": f"k{i}", "route": "r", "due_at": now - 600}
                                   for i in range(200)])
    _wait_exact(node)
    ready = ReadySet.attach(node.name)
    try:
        wait_for(lambda: len(ready.snapshot().entries) == 200, 10, "200 keys published")
        old_keeper = node.pids()["keeper"]
        os.kill(old_keeper, signal.SIGKILL)
        # Meanwhile the last set is still readable.
        assert len(ready.snapshot().entries) == 200
        wait_for(lambda: node.pids()["keeper"] not in (None, old_keeper), 20,
                 "a new keeper in node.json")
        wait_for(lambda: _vouched(node.name), 20, "keeper vouching again")
        node.request("POST", "/rows", [{"key": "after-restart", "route": "r"}])
        _wait_exact(node)
    finally:
        ready.close()
    assert "child_died" in node.log()
    assert node.stop() == 0


def test_sigstop_keeper_is_seen_as_stalled(node):
    from shm.ready import ReadySet

    node.start()
    node.request("POST", "/rows", [{"key": "a", "route": "r", "due_at": time.time() - 60}])
    wait_for(lambda: _vouched(node.name), 20, "vouching")
    ready = ReadySet.attach(node.name)
    wait_for(lambda: [e.key for e in ready.snapshot().entries] == ["a"], 10, "a published")
    keeper = node.pids()["keeper"]
    os.kill(keeper, signal.SIGSTOP)
    try:
        stalled_at = time.monotonic()
        state = wait_for(lambda: (s := _state(node.name)) and not s["trust"]["vouched"] and s,
                         10, "readers to see the stall")
        assert time.monotonic() - stalled_at < 10
        assert "stalled" in state["trust"]["reason"]
        out = subprocess.run([sys.executable, "-m", "node", "state", "--name", node.name],
                             cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert out.returncode == 3
        assert [e.key for e in ready.snapshot().entries] == ["a"]
    finally:
        ready.close()
        os.kill(keeper, signal.SIGCONT)
    wait_for(lambda: _vouched(node.name), 20, "vouching again after SIGCONT")
    assert node.stop() == 0


def test_kill_supervisor_leaves_no_child_and_restart_reattaches(node, tmp_path):
    node.start()
    node.request("POST", "/rows", [{"key": f"k{i}", "route": "r"} for i in range(50)])
    pids = node.pids()
    children = [pids["keeper"], *pids["workers"]]
    os.kill(node.proc.pid, signal.SIGKILL)
    node.proc.wait()

    def all_gone():
        return all(not psutil.pid_exists(p) or psutil.Process(p).status() == "zombie"
                   for p in children)
    wait_for(all_gone, 10, "every child to die with the supervisor")
    # The segments stayed (a crash); a restarted node attaches and serves.
    again = NodeProcess(node.data_dir, node.name)
    again.start()
    try:
        _wait_exact(again)
        assert len(_dump(again)) == 50
    finally:
        assert again.stop() == 0


def test_two_nodes_on_one_host_do_not_meet(tmp_path, node_name):
    a = NodeProcess(tmp_path / "a", node_name + "a").start()
    b = NodeProcess(tmp_path / "b", node_name + "b").start()
    second = NodeProcess(tmp_path / "c", a.name)
    try:
        a.request("POST", "/rows", [{"key": "only-a", "route": "r", "due_at": time.time() - 60}])
        wait_for(lambda: (s := _vouched(a.name)) and s["now"]["due"]["total"] == 1, 20, "a counts")
        sb = wait_for(lambda: _vouched(b.name), 20, "b vouching")
        assert sb["now"]["due"]["total"] == 0
        with pytest.raises(AssertionError, match="already runs"):
            second.start(timeout_s=20)
    finally:
        assert a.stop() == 0
        assert b.stop() == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lease-s", "0"], "lease_s"),
        (["--http", "0.0.0.0:0"], "token"),
        (["--store", "mysql://localhost/x"], "unknown store URL"),
        # A PostgreSQL server that is not there; the password is not shown.
        (["--store", "postgresql://u:pw-not-shown@127.0.0.1:1/x"], "PostgreSQL store"),
        (["--name", "bad name!"], "name"),
        (["--workers", "many"], "workers"),
    ],
)
def test_bad_arguments_one_line_exit_2(tmp_path, args, message):
    out = subprocess.run([sys.executable, "-m", "node", "run", "--data-dir", str(tmp_path), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    assert "pw-not-shown" not in out.stderr + out.stdout


def test_verbose_shows_the_traceback_and_still_exits_2_with_the_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "node", "run", "-v", "--data-dir", str(tmp_path),
                          "--lease-s", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 2, out
    assert "Traceback" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("node: "), out.stderr


def test_bad_config_file_names_the_line(tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text('lease_s = 30\n\n[routes.pages]\ncadence_s = 10\n')
    out = subprocess.run([sys.executable, "-m", "node", "run", "--config", str(cfg),
                          "--data-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert f"{cfg}:4" in out.stderr and "cadence_s" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "schedule.db").exists()


def test_env_overrides_file_and_flag_overrides_env(tmp_path):
    from node.config import load_config

    cfg = tmp_path / "node.toml"
    cfg.write_text("lease_s = 30\nready_size = 100\n")
    c = load_config({}, env={"QUEUE_NODE_LEASE_S": "45"}, config_file=cfg)
    assert (c.lease_s, c.ready_size) == (45, 100)
    c = load_config({"lease_s": "2m"}, env={"QUEUE_NODE_LEASE_S": "45"}, config_file=cfg)
    assert c.lease_s == 120


def test_keeper_exact_after_100k_mixed_writes_while_running(node):
    """100,000 writes (inserts, updates, deletes) through the node while it
    runs, plus another program writing the file: the keeper equals the table
    row for row."""
    import random

    node.start()
    rnd = random.Random(11)
    now = time.time()
    keys = [f"https://example.com/p/{i:07d}" for i in range(20_000)]
    written = 0
    conn = sqlite3.connect(node.data_dir / "schedule.db", timeout=10)
    try:
        while written < 100_000:
            batch = [
                {"key": rnd.choice(keys), "route": rnd.choice(["a", "b", "c"]),
                 "due_at": now + rnd.uniform(-86400, 86400), "sitemap": rnd.random() < 0.3}
                for _ in range(2000)
            ]
            status, _ = node.request("POST", "/rows", batch)
            assert status == 200
            doomed = rnd.sample(keys, 200)
            status, _ = node.request("POST", "/rows/delete", {"keys": doomed})
            assert status == 200
            with conn:
                conn.execute("UPDATE schedule SET due_at = due_at + 60 WHERE key = ?",
                             (rnd.choice(keys),))
            written += 2201
    finally:
        conn.close()
    _wait_exact(node, timeout_s=60)
    assert node.stop() == 0


def test_sighup_reclassifies_route_defaults(node, tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text("[routes.pages]\ncadence_s = 3600\n")
    node.args += ["--config", str(cfg)]
    node.start()
    node.request("POST", "/rows", [{"key": "p", "route": "pages", "due_at": time.time() - 600}])

    def cadence():
        status, body = node.request("GET", "/rows?key=p")
        keeper = body.get("keeper", {}) if status == 200 else {}
        return keeper.get("class", {}).get("cadence_s") if keeper.get("held") else None

    assert wait_for(cadence, 20, "the keeper to hold p") == 3600
    cfg.write_text("[routes.pages]\ncadence_s = 600\n")
    os.kill(node.proc.pid, signal.SIGHUP)
    wait_for(lambda: cadence() == 600, 20, "cadence 600 after SIGHUP")
    assert node.stop() == 0
