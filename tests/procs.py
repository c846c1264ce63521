"""Helpers for tests that watch real processes: deadline waits, a process's
scheduler state, and the test build of the C extensions with the lease
table's stops compiled in."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def wait_until(predicate: Callable[[], object], what: str, deadline_s: float = 20.0) -> None:
    """Poll ``predicate`` until it holds; AssertionError after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")
        time.sleep(0.002)  # a polling interval, not synchronisation


def proc_state(pid: int) -> str:
    """The process's state letter from /proc (``T`` stopped, ``Z`` zombie),
    or ``"gone"``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return "gone"
    return stat[stat.rfind(b")") + 2 :].split()[0].decode()


def build_with_stops(base: Path) -> Path:
    """The test build of shm._atomic and shm._claim (setup.py with
    QUEUE_NODE_TEST_STOPS=1: the lease table's stops compiled in) under
    ``base``, built once: the directory to give children as
    QUEUE_NODE_TEST_BUILD."""
    dest = base / "stops-build"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    wanted = [dest / "shm" / f"{name}{suffix}" for name in ("_atomic", "_claim")]
    if not all(path.exists() for path in wanted):
        subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(dest),
             "--build-temp", str(base / "stops-objects"), "--force"],
            cwd=ROOT,
            env=dict(os.environ, QUEUE_NODE_TEST_STOPS="1"),
            check=True,
            capture_output=True,
            timeout=100,
        )  # fmt: skip
    return dest
