"""The nemesis: a seeded random schedule of faults against a running node.

``schedule(seed, n)`` is a pure function of the seed: the same seed gives the
same actions, in the same order, with the same pauses and durations, so a
failing run is rerun by its seed. When ``n`` is at least the number of kinds,
every kind comes at least once (a shuffled round of all kinds, then random
picks), and the clean restart falls in the first half (while the producer is
still loading). A disk fault kills the ledger halfway through half the time
(``crash``): always the first ``eio``, never the first ``enospc``, so a short
schedule has both a plain full disk and a crash while the log cannot write.

Every action is printed (and logged) with its wall time; the faults that last
(a SIGSTOP, a full disk) are logged with their start ``t0`` and end ``t1``,
which the checker uses as evidence.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from node.testing import NodeProcess, wait_for
from tests.campaign.workload import EventLog

KINDS = (
    "kill_keeper",       # kill -9 one child: the supervisor restarts it
    "kill_worker",
    "kill_inference",
    "kill_ledger",
    "kill_supervisor",   # its children die by PDEATHSIG; the operator starts it again
    "kill_node",         # the whole process group, kill -9
    "stop_keeper",       # SIGSTOP for a few seconds, then SIGCONT
    "stop_ledger",
    "enospc",            # the completion log's disk is full for a while
    "eio",               # one burst of I/O errors
    "slow_fsync",        # every fsync slow for a while
    "sigterm_restart",   # a clean restart while the producer is loading
)  # fmt: skip
# The actions after which the ledger is a new process (offers are forgotten).
RESTART_TIMEOUT_S = 60.0
# "eio once": long enough that a completion or an ack under load meets it.
EIO_S = 1.0
# How often a full disk or an I/O error also kills the ledger halfway through.
CRASH_P = 0.5


@dataclass(frozen=True)
class Action:
    kind: str
    pause_s: float  # before the action
    hold_s: float  # how long a lasting fault lasts
    pick: float  # which process, when there are several (0..1)
    crash: bool = False  # a disk fault: kill -9 the ledger halfway through


def schedule(seed: int, n: int, pause_s: tuple[float, float] = (1.0, 3.0)) -> list[Action]:
    rng = random.Random(seed)
    kinds: list[str] = []
    if n >= len(KINDS):
        kinds = list(KINDS)
        rng.shuffle(kinds)
    kinds += [rng.choice(KINDS) for _ in range(n - len(kinds))]
    kinds = kinds[:n]
    if "sigterm_restart" in kinds:
        at = kinds.index("sigterm_restart")
        if at >= max(1, n // 2):
            to = rng.randrange(max(1, n // 2))
            kinds[at], kinds[to] = kinds[to], kinds[at]
    actions = []
    for i, kind in enumerate(kinds):
        crash = rng.random() < CRASH_P
        if kinds.index(kind) == i:  # the first of its kind: both variants always run
            crash = kind == "eio"
        pause = rng.uniform(*pause_s)
        actions.append(Action(kind, pause, round(rng.uniform(1.5, 4.0), 2), rng.random(), crash))
    return actions


class Nemesis:
    """Runs a schedule against ``node`` (a NodeProcess it may restart).

    ``fill``/``free`` make the completion log's disk full and free again: the
    fault seam's control file by default, a real small filesystem with
    ``--tmpfs``. ``loading()`` says whether the producer is still writing."""

    def __init__(
        self,
        node: NodeProcess,
        log: EventLog,
        control: Path,
        loading: Callable[[], bool],
        fs: Path | None = None,
    ) -> None:
        self.node = node
        self.log = log
        self.control = control
        self.loading = loading
        self.fs = fs
        self.stop_event = threading.Event()
        self.done: list[dict[str, Any]] = []

    # -- helpers ----------------------------------------------------------------------

    def _say(self, kind: str, t0: float, **fields: Any) -> None:
        t1 = time.time()
        doc = {"kind": kind, "t0": t0, "t1": t1, **fields}
        self.done.append(doc)
        self.log.write("fault", **doc)
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        print(f"nemesis {time.strftime('%H:%M:%S', time.localtime(t0))}"
              f"+{t1 - t0:4.1f}s {kind} {extra}", flush=True)  # fmt: skip

    def _hold(self, seconds: float) -> None:
        self.stop_event.wait(seconds)  # the fault's duration, not synchronisation

    def _pid(self, role: str, pick: float) -> int | None:
        pids = self.node.pids().get(role)
        if isinstance(pids, list):
            pids = [p for p in pids if p]
            return pids[int(pick * len(pids))] if pids else None
        return pids

    def _all_pids(self) -> list[int]:
        pids = self.node.pids()
        out = [self.node.proc.pid, pids.get("keeper"), pids.get("ledger")]
        out += list(pids.get("workers") or []) + list(pids.get("inference") or [])
        return [p for p in out if p]

    def _wait_gone(self, pids: list[int]) -> None:
        def gone() -> bool:
            for pid in pids:
                try:
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        return False
                except psutil.NoSuchProcess:
                    pass
            return True

        wait_for(gone, 20, "every process of the node to die")

    def wait_healthy(self, timeout_s: float = RESTART_TIMEOUT_S) -> None:
        """Every process of node.json alive and /readyz 200."""

        def healthy() -> bool:
            if self.node.proc.poll() is not None:
                raise AssertionError(f"the node exited {self.node.proc.returncode}")
            try:
                if not all(psutil.pid_exists(p) for p in self._all_pids()):
                    return False
                return self.node.request("GET", "/readyz", timeout_s=2)[0] == 200
            except (OSError, KeyError, AssertionError):
                return False

        wait_for(healthy, timeout_s, "the node healthy again")

    # -- the faults --------------------------------------------------------------------

    def kill(self, role: str, pick: float) -> dict[str, Any]:
        pid = self._pid(role, pick)
        if pid is None:
            return {"skipped": f"no {role}"}
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return {"pid": pid, "skipped": "already gone"}
        return {"pid": pid}

    def pause(self, role: str, hold_s: float) -> dict[str, Any]:
        pid = self._pid(role, 0)
        os.kill(pid, signal.SIGSTOP)
        try:
            self._hold(hold_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        return {"pid": pid, "for_s": hold_s}

    def restart(self, how: str) -> dict[str, Any]:
        pids = self._all_pids()
        if how == "kill_supervisor":
            os.kill(self.node.proc.pid, signal.SIGKILL)  # children follow by PDEATHSIG
            self.node.proc.wait()
        elif how == "kill_node":
            self.node.kill()
        else:
            rc = self.node.stop(timeout_s=60)
            if rc != 0:
                raise AssertionError(f"a clean stop exited {rc}:\n{self.node.log()}")
        self._wait_gone(pids)
        self.node.start(timeout_s=RESTART_TIMEOUT_S)
        return {"loading": self.loading()} if how == "sigterm_restart" else {}

    def disk(self, word: str, hold_s: float, crash: bool = False) -> dict[str, Any]:
        """The completion log's disk faulty for ``hold_s``; with ``crash``,
        the ledger is killed halfway through (acks answered but not yet
        durable, a cut-back that failed: the windows a crash opens)."""
        fields: dict[str, Any] = {"for_s": hold_s}
        if self.fs is not None and word == "enospc":
            fields["via"] = "tmpfs"
            filler = fill(self.fs)
            undo = filler.unlink
        else:
            self.control.write_text(word + "\n")
            undo = lambda: self.control.write_text("")  # noqa: E731
        try:
            self._hold(hold_s / 2)
            if crash:
                fields["ledger_killed"] = self.kill("ledger", 0).get("pid")
            self._hold(hold_s / 2)
        finally:
            undo()
        return fields

    def act(self, action: Action) -> None:
        t0 = time.time()
        kind = action.kind
        if kind.startswith("kill_") and kind not in ("kill_supervisor", "kill_node"):
            role = {"kill_worker": "workers"}.get(kind, kind[5:])
            fields = self.kill(role, action.pick)
        elif kind in ("kill_supervisor", "kill_node", "sigterm_restart"):
            fields = self.restart(kind)
        elif kind.startswith("stop_"):
            fields = self.pause(kind[5:], action.hold_s)
        elif kind == "enospc":
            fields = self.disk("enospc", action.hold_s, crash=action.crash)
        elif kind == "eio":
            fields = self.disk("eio", EIO_S, crash=action.crash)
        elif kind == "slow_fsync":
            fields = self.disk("slow_fsync 0.3", action.hold_s)
        else:
            raise ValueError(kind)
        self._say(kind, t0, **fields)

    def run(self, actions: list[Action]) -> None:
        for action in actions:
            if self.stop_event.wait(action.pause_s):  # the schedule's pause
                return
            self.act(action)
            self.wait_healthy()

    def heal(self) -> None:
        """Undo whatever may be left: disk faults off, stopped processes
        continued, a dead node started again."""
        self.control.write_text("")
        if self.fs is not None:
            for path in self.fs.glob("filler*"):
                path.unlink()
        if self.node.proc is not None and self.node.proc.poll() is None:
            for pid in self._all_pids():
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        else:
            self.node.start(timeout_s=RESTART_TIMEOUT_S)
        self.wait_healthy()


# -- a real small filesystem under the completion log ------------------------------------


def mount_tmpfs(where: Path, size: str = "2m") -> str | None:
    """Mount a tmpfs of ``size`` on ``where``; the reason when it cannot."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(where)], capture_output=True, text=True, timeout=30)  # fmt: skip
    return None if proc.returncode == 0 else (proc.stderr.strip() or str(proc.returncode))


def umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(directory: Path) -> Path:
    """Write a file until the filesystem says ENOSPC."""
    filler = directory / "filler"
    chunk = b"\0" * 65536
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
    return filler
