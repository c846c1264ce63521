"""Run ``python -m node`` as a real subprocess, for acceptance tests.

Waits are event- or deadline-based: poll a condition until it holds or the
deadline passes, never a bare sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent


def wait_for(cond: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(delay)  # polling interval of a deadline wait, not synchronisation
        delay = min(delay * 2, 0.1)


def cleanup_segments(name: str) -> None:
    """Remove what a node of ``name`` may have left in shared memory (a test
    that kills a node leaves its segments, as a crash would)."""
    from keeper.ask import unlink_all
    from shm.leases import LeaseTable
    from shm.ready import ReadySet
    from shm.state import StateBuffer
    from shm.wake import Wake

    for cls in (ReadySet, StateBuffer, Wake, LeaseTable):
        cls.unlink(name)
    unlink_all(name)


class NodeProcess:
    def __init__(self, data_dir: Path, name: str, *args: str, env: dict | None = None) -> None:
        self.data_dir = data_dir
        self.name = name
        self.args = list(args)
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("QUEUE_NODE_TEST_HOOKS", "1")
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir / "node.log"

    def start(self, wait_ready: bool = True, timeout_s: float = 30.0) -> NodeProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        node_json = self.data_dir / "node.json"
        if node_json.exists():
            node_json.unlink()
        argv = [
            sys.executable, "-m", "node", "run",
            "--data-dir", str(self.data_dir),
            "--name", self.name,
            "--http", "127.0.0.1:0",
            "--workers", "1",
            *self.args,
        ]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        wait_for(lambda: self._node_json_ok() or self._died(), timeout_s, "node.json")
        if self.proc.poll() is not None:
            raise AssertionError(f"node exited {self.proc.returncode}:\n{self.log()}")
        if wait_ready:
            self.wait_ready(timeout_s)
        return self

    def _died(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def _node_json_ok(self) -> bool:
        try:
            doc = json.loads((self.data_dir / "node.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        self.info = doc
        return True

    def node_json(self) -> dict:
        assert self._node_json_ok()
        return self.info

    @property
    def base_url(self) -> str:
        return f"http://{self.info['http']}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def request(self, method: str, path: str, body: Any = None,
                headers: dict | None = None, timeout_s: float = 10.0) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})}
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            with exc:  # it holds the connection: closed here, not by the GC mid-test
                raw = exc.read()
            try:
                return exc.code, json.loads(raw)
            except json.JSONDecodeError:
                return exc.code, raw.decode(errors="replace")

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        def ready() -> bool:
            if self._died():
                raise AssertionError(f"node exited {self.proc.returncode}:\n{self.log()}")
            try:
                status, _ = self.request("GET", "/readyz", timeout_s=2)
            except OSError:
                return False
            return status == 200
        wait_for(ready, timeout_s, "/readyz 200")

    def pids(self) -> dict:
        self._node_json_ok()
        return self.info["pids"]

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"node did not stop within {timeout_s} s:\n{self.log()}") from None
        self.close_log()
        return rc

    def close_log(self) -> None:
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()

    def kill(self) -> None:
        """kill -9 the supervisor and every process it started."""
        if self.proc is None:
            return
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        self.proc.kill()
        self.proc.wait()
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        self.close_log()


def finish(nodes: Iterable[NodeProcess], name: str) -> None:
    """A test's teardown: kill the nodes still running, close their logs,
    remove the segments a killed node left behind."""
    for node in nodes:
        if node.proc is not None and node.proc.poll() is None:
            node.kill()
        node.close_log()
    cleanup_segments(name)
