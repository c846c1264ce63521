"""``python -m node state [--name NAME] [--watch]`` against a real node."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from node.testing import ROOT, NodeProcess, finish, wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def node(tmp_path, node_name):
    proc = NodeProcess(tmp_path / "data", node_name, env={"QUEUE_NODE_STATE_INTERVAL_S": "0.3"})
    yield proc
    finish([proc], node_name)


def _state(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node", "state", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


class Watch:
    """``state --watch`` as a subprocess; a thread reads its lines, so a test
    waits for each line up to a deadline (a pipe's buffered text would fool
    select)."""

    def __init__(self, name: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "node", "state", "--name", name, "--watch"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def lines(self, n: int, timeout_s: float) -> list[str]:
        """The next ``n`` lines, waiting up to ``timeout_s`` in all."""
        deadline = time.monotonic() + timeout_s
        out: list[str] = []
        while len(out) < n:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{len(out)} of {n} lines in {timeout_s} s: {out}") from None
            if line is None:
                raise AssertionError(f"exited {self.proc.wait()} after {out}: {self.stderr()}")
            out.append(line)
        return out

    def docs(self, n: int, timeout_s: float) -> list[dict]:
        return [json.loads(line) for line in self.lines(n, timeout_s)]

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read()

    def wait(self, timeout_s: float) -> int:
        rc = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout_s)
        return rc

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def _vouched(name: str) -> bool:
    out = _state("--name", name)
    return out.returncode == 0


def test_plain_state_exit_codes(node, node_name):
    node.start()
    node.request("POST", "/rows", [{"key": "k", "route": "r", "due_at": time.time() - 60}])
    wait_for(lambda: _vouched(node.name), 30, "exit 0 once vouched")
    out = _state("--name", node.name)
    doc = json.loads(out.stdout)
    assert set(doc) >= {"now", "coming", "lateness", "flow", "classes", "trust"}
    assert doc["trust"]["vouched"] is True and doc["now"]["in_flight"] == 0
    assert len(out.stdout.splitlines()) == 1
    missing = _state("--name", node_name + "-none")
    assert missing.returncode == 4 and missing.stdout == ""
    assert "does not exist" in missing.stderr
    bad = _state("--name", "no/slash")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert node.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_watch_prints_every_new_document_until_a_signal(node, sig):
    node.start()
    wait_for(lambda: _vouched(node.name), 30, "vouched")
    watch = Watch(node.name)
    try:
        docs = watch.docs(3, 30)
        assert all(doc["trust"]["vouched"] for doc in docs)
        counts_at = [doc["trust"]["counts_at"] for doc in docs]
        assert counts_at == sorted(set(counts_at)), "one line per new document"
        assert docs[-1]["now"]["at"] == counts_at[-1]
        watch.proc.send_signal(sig)
        assert watch.wait(20) == 0
        assert "Traceback" not in watch.stderr()
    finally:
        watch.close()
    assert node.stop() == 0


def test_watch_exits_4_when_there_is_no_node_or_it_stops(node, node_name):
    absent = Watch(node_name)
    try:
        assert absent.wait(60) == 4  # no node yet
        assert "does not exist" in absent.stderr()
    finally:
        absent.close()
    node.start()
    watch = Watch(node.name)
    try:
        watch.lines(1, 30)
        assert node.stop() == 0
        assert watch.wait(30) == 4
        assert "node state:" in watch.stderr()
    finally:
        watch.close()


def test_watch_keeps_printing_while_the_keeper_is_stopped(node):
    node.start()
    wait_for(lambda: _vouched(node.name), 30, "vouched")
    keeper = node.pids()["keeper"]
    watch = Watch(node.name)
    try:
        watch.lines(1, 30)
        os.kill(keeper, signal.SIGSTOP)
        try:
            # No new document comes; the state is printed anyway, and soon
            # says that the keeper no longer vouches.
            def unvouched() -> bool:
                return not watch.docs(1, 20)[0]["trust"]["vouched"]

            wait_for(unvouched, 60, "a line saying the keeper does not vouch")
        finally:
            os.kill(keeper, signal.SIGCONT)
        watch.proc.send_signal(signal.SIGTERM)
        assert watch.wait(20) == 0
    finally:
        watch.close()
    assert node.stop() == 0
