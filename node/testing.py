"""The one node harness: ``python -m node run`` as a child process.

Used by the acceptance tests, ``python -m node demo`` and the soak
(``bench/soak.py``): start a node on a data directory (and a config), wait
until it is up, talk to it over HTTP, stop it with SIGTERM or kill -9 it and
every process it started, read its log when something went wrong, and remove
the shared memory a killed node left behind.

Waits are event- or deadline-based: poll a condition until it holds or the
deadline passes, never a bare sleep. Nothing in the node's own processes
imports this module.
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

# The checkout's root (the directory holding the ``node`` package): the
# default working directory of a node, so ``--handler tests.handlers:…`` and
# the like import from the checkout.
ROOT = Path(__file__).resolve().parent.parent


class HarnessError(AssertionError):
    """The node did not start, died, or did not stop in time. An
    AssertionError, so a test that hits it fails with the node's log."""


def wait_for(cond: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition") -> Any:
    """Poll ``cond`` until it returns something true (returned) or
    ``timeout_s`` passes (HarnessError)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise HarnessError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(delay)  # polling interval of a deadline wait, not synchronisation
        delay = min(delay * 2, 0.1)


def cleanup_segments(name: str) -> None:
    """Remove what a node of ``name`` may have left in shared memory (a node
    that was killed leaves its segments, as a crash would)."""
    from keeper.ask import unlink_all
    from shm.classes import SharedClasses
    from shm.leases import LeaseTable
    from shm.ready import ReadySet
    from shm.state import StateBuffer
    from shm.wake import Wake

    for cls in (ReadySet, StateBuffer, Wake, LeaseTable, SharedClasses):
        cls.unlink(name)
    unlink_all(name)


class NodeProcess:
    """One ``python -m node run --data-dir DATA_DIR --name NAME --http
    127.0.0.1:0 --workers N [--config FILE] ARGS…``, its output appended to
    ``log_path`` (``<data-dir>/node.log``; set it before ``start`` to put it
    elsewhere).

    ``env`` is added to this process's environment; ``test_hooks`` sets
    ``QUEUE_NODE_TEST_HOOKS=1`` unless ``env`` says otherwise; ``cwd`` is the
    node's working directory (None: this process's).
    """

    # How much of the log's end a failure message carries.
    LOG_TAIL_CHARS = 6000

    def __init__(
        self,
        data_dir: Path,
        name: str,
        *args: str,
        env: dict[str, str] | None = None,
        config: Path | None = None,
        workers: int = 1,
        test_hooks: bool = True,
        cwd: Path | None = ROOT,
    ) -> None:
        self.data_dir = data_dir
        self.name = name
        self.args = list(args)
        self.config = config
        self.workers = workers
        self.env = dict(os.environ, **(env or {}))
        if test_hooks:
            self.env.setdefault("QUEUE_NODE_TEST_HOOKS", "1")
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir / "node.log"
        self.info: dict[str, Any] = {}

    def argv(self) -> list[str]:
        config = [] if self.config is None else ["--config", str(self.config)]
        return [
            sys.executable, "-m", "node", "run",
            *config,
            "--data-dir", str(self.data_dir),
            "--name", self.name,
            "--http", "127.0.0.1:0",
            "--workers", str(self.workers),
            *self.args,
        ]  # fmt: skip

    # -- start ---------------------------------------------------------------------------

    def start(self, wait_ready: bool = True, timeout_s: float = 30.0) -> NodeProcess:
        """Start the node and wait until its ``node.json`` is written and
        (``wait_ready``) ``GET /readyz`` answers 200; HarnessError, with the
        log's end, when it exits first or ``timeout_s`` passes."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        node_json = self.data_dir / "node.json"
        if node_json.exists():  # a killed node's: not this one's address
            node_json.unlink()
        self.info = {}
        with open(self.log_path, "ab") as log:  # the child holds its own descriptor
            self.proc = subprocess.Popen(
                self.argv(), cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_for(lambda: self._node_json_ok() or self.exited(), timeout_s, "node.json")
        self.check_alive()
        if wait_ready:
            self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until ``GET /readyz`` answers 200 (the keeper has published
        and the ledger answers)."""

        def ready() -> bool:
            self.check_alive()
            try:
                status, _ = self.request("GET", "/readyz", timeout_s=2)
            except OSError:
                return False
            return status == 200

        wait_for(ready, timeout_s, "/readyz 200")

    # -- what it is ------------------------------------------------------------------------

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def check_alive(self) -> None:
        """HarnessError, with the log's end, when the node has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise HarnessError(
                f"the node exited with status {self.proc.returncode}; "
                f"the end of {self.log_path}:\n{self.log()}"
            )

    def _node_json_ok(self) -> bool:
        try:
            doc = json.loads((self.data_dir / "node.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        self.info = doc
        return True

    def node_json(self) -> dict:
        """The node's ``node.json`` as it is now (pid, pids, http, …)."""
        assert self._node_json_ok()
        return self.info

    @property
    def base_url(self) -> str:
        """The node's API (``node.client.Client`` takes it): ``http://host:port``,
        or ``unix:/path`` for a node on a socket file."""
        http = self.info["http"]
        return http if http.startswith("unix:") else f"http://{http}"

    def pids(self) -> dict:
        """``node.json``'s ``pids``: keeper, ledger, workers [...], inference [...]."""
        self._node_json_ok()
        return self.info["pids"]

    def pids_by_role(self) -> dict[str, int]:
        """role -> pid: supervisor, keeper, ledger, rows (on PostgreSQL),
        worker-N, inference-N."""
        self._node_json_ok()
        pids = self.info.get("pids") or {}
        out = {"supervisor": self.info.get("pid")}
        for role in ("keeper", "ledger", "rows"):
            out[role] = pids.get(role)
        for role in ("workers", "inference"):
            for i, pid in enumerate(pids.get(role) or []):
                out[f"{role.rstrip('s')}-{i}"] = pid
        return {role: pid for role, pid in out.items() if isinstance(pid, int)}

    def log(self) -> str:
        """The end of the node's log (``LOG_TAIL_CHARS``)."""
        try:
            return self.log_path.read_text(errors="replace")[-self.LOG_TAIL_CHARS :]
        except FileNotFoundError:
            return ""

    # -- talking to it -----------------------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None,
        headers: dict | None = None, timeout_s: float = 10.0,
    ) -> tuple[int, Any]:  # fmt: skip
        """One JSON request over TCP: (status, the decoded body; the text when
        it is not JSON). OSError when nothing answers."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})}
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers=headers)  # fmt: skip
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

    # -- stop ----------------------------------------------------------------------------------

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then wait for the drain: the node's exit status. When it
        does not stop within ``timeout_s`` it is killed (``kill``) and
        HarnessError raised, with the log's end."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise HarnessError(f"node did not stop within {timeout_s} s:\n{self.log()}") from None

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


def finish(nodes: Iterable[NodeProcess], name: str) -> None:
    """A test's teardown: kill the nodes still running and remove the
    segments a killed node left behind."""
    for node in nodes:
        if node.proc is not None and node.proc.poll() is None:
            node.kill()
    cleanup_segments(name)
