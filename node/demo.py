"""``python -m node demo [--rows N] [--data-dir DIR]``: the whole node, end to end.

Seeds a schedule (``DEFAULT_ROWS`` rows over several routes, cadences and
sitemap flags, every row due) in a fresh data directory, starts
``python -m node run`` with the built-in CPU handler
(``node.handlers:cpu_work``) in two inference processes, and plays the
producer: it polls ``GET /results``, acknowledges every result, and shows
progress (due, in flight, finished, acknowledged). When every item is
acknowledged it stops the node with SIGTERM and prints the final ledger
(``GET /accounting``).

Exit 0 only when the ledger balanced, every item was acknowledged exactly
once, and the node stopped cleanly; 1 otherwise; 2 for bad arguments or a
data directory it will not touch.

The data directory: the demo creates it, or reuses one a previous demo left
(it carries ``MARKER``). Anything else that is not empty is refused, so the
demo never deletes someone's node data. The directory is left in place
afterwards (``node.log`` holds every process's log).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.core.errors import ConfigError, NodeError
from node.core.proc import RET_ERROR, RET_OK
from node.testing import HarnessError, NodeProcess

DEFAULT_ROWS = 20_000
MAX_ROWS = 1_000_000
DEFAULT_DATA_DIR = Path("node-demo")
MARKER = ".queue-node-demo"
# Two inference processes with the CPU handler: enough to show claims
# spreading over processes on any laptop.
INFERENCE_PROCS = 2
HTTP_WORKERS = 2
# A short lease, so a stalled process shows up (expired) in seconds.
LEASE_S = 10
# Routes of the seeded schedule: (route, its cadence, job). Every cadence is a
# day or more, so each row runs once during the demo.
ROUTES = (
    ("pages", "1d", "demo-pages"),
    ("listings", "7d", "demo-listings"),
    ("documents", "30d", "demo-documents"),
)
# Every SITEMAP_EVERY-th row has the sitemap flag, every OWN_CADENCE_EVERY-th
# its own cadence (30 days) instead of its route's.
SITEMAP_EVERY = 4
OWN_CADENCE_EVERY = 5
OWN_CADENCE_S = 30 * 86400
# Rows are spread over this much lateness, so ranks differ.
SPREAD_S = 6 * 3600
SEED_BATCH = 5_000
POLL_MAX = 1_000
# A result poll waits this long for the first result: the producer idles on
# the node, not on a sleep.
POLL_WAIT_S = 0.25
REFRESH_S = 0.5
PLAIN_REFRESH_S = 2.0
START_TIMEOUT_S = 60.0
# No item finished or acknowledged for this long: the demo gives up.
STALL_S = 60.0
STOP_GRACE_S = 15.0
# After the last ack, how long the display waits for the keeper's counts.
SETTLE_S = 3.0


class DemoError(NodeError):
    """The demo could not run to the end."""


@dataclass
class Tally:
    """What the producer saw: acks per key, and results per key."""

    rows: int
    acked: dict[str, int] = field(default_factory=dict)
    results: int = 0
    duplicates: int = 0  # a key whose result came (and was acked) more than once
    bad_results: int = 0

    @property
    def acked_keys(self) -> int:
        return len(self.acked)

    def take(self, found: list[dict[str, Any]]) -> dict[str, list[int]]:
        """Count the offered results; the ids to ack, by job."""
        by_job: dict[str, list[int]] = {}
        for item in found:
            self.results += 1
            key = item["key"]
            count = self.acked.get(key, 0) + 1
            self.acked[key] = count
            if count > 1:
                self.duplicates += 1
            result = item.get("result")
            if not isinstance(result, dict) or "digest" not in result:
                self.bad_results += 1
            by_job.setdefault(item["job"], []).append(item["id"])
        return by_job


# -- the data directory --------------------------------------------------------------


def prepare_data_dir(path: Path) -> Path:
    """A fresh directory for the demo: created, or a previous demo's emptied.
    ConfigError for anything else that is not empty, or a demo still running."""
    path = path.expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--data-dir {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        if not (path / MARKER).exists():
            raise ConfigError(
                f"--data-dir {path} exists and is not empty; the demo needs a fresh "
                "directory (or one a previous demo left)"
            )
        pid = _running_pid(path)
        if pid is not None:
            raise ConfigError(f"a demo node still runs in {path} (pid {pid}); stop it first")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    (path / MARKER).write_text("written by python -m node demo; safe to delete\n")
    return path.resolve()


def _running_pid(path: Path) -> int | None:
    from shm.segment import pid_alive

    try:
        doc = json.loads((path / "node.json").read_text())
    except (OSError, ValueError):
        return None
    pid = doc.get("pid")
    return pid if isinstance(pid, int) and pid_alive(pid) else None


def write_config(data_dir: Path) -> Path:
    # Counts every second (not 5): the progress shows the keeper's own numbers.
    lines = ["# written by python -m node demo", f"lease_s = {LEASE_S}", "state_interval_s = 1", ""]
    for route, cadence, _job in ROUTES:
        lines += [f"[routes.{route}]", f'cadence_s = "{cadence}"', ""]
    path = data_dir / "demo.toml"
    path.write_text("\n".join(lines))
    return path


def demo_rows(n: int, now: float) -> list[Any]:
    """The seeded schedule: ``n`` rows, all due, deterministic."""
    from node.core.rows import RowWrite

    rows = []
    for i in range(n):
        route, _cadence, job = ROUTES[i % len(ROUTES)]
        lateness_s = 60 + (i * 7919) % SPREAD_S  # a past minute, spread out
        rows.append(
            RowWrite(
                key=f"{route}/{i:07d}",
                route=route,
                cadence_s=OWN_CADENCE_S if i % OWN_CADENCE_EVERY == 0 else None,
                sitemap=i % SITEMAP_EVERY == 0,
                due_at=now - lateness_s,
                payload={"n": i, "text": f"item {i} of {route}"},
                job=job,
            )
        )
    return rows


def seed(data_dir: Path, n: int, now: float) -> None:
    from node.store import open_store

    store = open_store(f"sqlite:///{data_dir}/schedule.db")
    try:
        rows = demo_rows(n, now)
        for start in range(0, n, SEED_BATCH):
            store.upsert(rows[start : start + SEED_BATCH], now=now)
    finally:
        store.close()


# -- the node ---------------------------------------------------------------------------


class DemoNode(NodeProcess):
    """``python -m node run`` with the CPU handler (``node.testing``'s
    harness), its output in ``<data-dir>/node.log``, and a client of its API."""

    # A failure message carries the end of the log, not a test's screenful.
    LOG_TAIL_CHARS = 1500

    def __init__(self, data_dir: Path, config: Path) -> None:
        super().__init__(
            data_dir, f"demo-{os.getpid()}",
            "--handler", "node.handlers:cpu_work",
            "--inference-procs", str(INFERENCE_PROCS),
            config=config, workers=HTTP_WORKERS, test_hooks=False, cwd=None,
        )  # fmt: skip
        self.client: Any = None

    def start(self, wait_ready: bool = True, timeout_s: float = START_TIMEOUT_S) -> DemoNode:
        from node.client import Client

        super().start(wait_ready, timeout_s)
        self.client = Client(self.base_url)
        return self

    def close(self) -> int | None:
        """Close the client, SIGTERM the node and wait for the drain: its exit
        status (None if it had to be killed)."""
        if self.client is not None:
            self.client.close()
        try:
            return self.stop(timeout_s=30 + STOP_GRACE_S)
        except HarnessError:
            return None


# -- progress ---------------------------------------------------------------------------


@dataclass
class Snapshot:
    due: int | None
    in_flight: int
    finished: int
    acknowledged: int
    vouched: bool


def snapshot(node: DemoNode) -> Snapshot:
    """Due rows from the state buffer (the keeper's counts, read in shared
    memory as an autoscaler would), the rest from the ledger."""
    from shm.state import read_state

    try:
        state = read_state(node.name)
    except NodeError:
        state = {}
    account = node.client.accounting()
    due = ((state.get("now") or {}).get("due") or {}).get("total")
    return Snapshot(
        due=due,
        in_flight=account["in_flight"],
        finished=account["finished"],
        acknowledged=account["acknowledged"],
        vouched=bool((state.get("trust") or {}).get("vouched")),
    )


class Display:
    """Progress bars when stdout is a terminal and rich is there; otherwise a
    plain line every ``PLAIN_REFRESH_S``."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}
        self._last_plain = 0.0
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            return
        console = Console()
        if not console.is_terminal:
            return
        self._progress = Progress(
            TextColumn("{task.description:>14}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        for name in ("due", "in flight", "finished", "acknowledged"):
            self._tasks[name] = self._progress.add_task(name, total=rows)

    def __enter__(self) -> Display:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def show(self, snap: Snapshot, acked_keys: int, last: bool = False) -> None:
        if self._progress is not None:
            values = {
                "due": snap.due or 0,
                "in flight": snap.in_flight,
                "finished": snap.finished,
                "acknowledged": acked_keys,
            }
            for name, value in values.items():
                self._progress.update(self._tasks[name], completed=value)
            return
        now = time.monotonic()
        if now - self._last_plain >= PLAIN_REFRESH_S or last:
            self._last_plain = now
            print(
                f"due {snap.due if snap.due is not None else '?'}  in flight {snap.in_flight}  "
                f"finished {snap.finished}/{self.rows}  acknowledged {acked_keys}/{self.rows}",
                flush=True,
            )


# -- the producer ---------------------------------------------------------------------------


def produce(node: DemoNode, tally: Tally, display: Display) -> dict[str, Any]:
    """Poll and acknowledge until every row's result is acknowledged and
    nothing is in flight; the ledger then."""
    client = node.client
    last_refresh = 0.0
    progress_at = time.monotonic()
    last_seen = (-1, -1)
    while True:
        node.check_alive()
        found = client.poll(None, max=POLL_MAX, wait_s=POLL_WAIT_S)
        for job, ids in tally.take(found).items():
            client.ack(job, ids)
        now = time.monotonic()
        if now - last_refresh < REFRESH_S and tally.acked_keys < tally.rows:
            continue
        last_refresh = now
        snap = snapshot(node)
        display.show(snap, tally.acked_keys)
        seen = (snap.finished, tally.acked_keys)
        if seen != last_seen:
            last_seen, progress_at = seen, now
        elif now - progress_at >= STALL_S:
            raise DemoError(
                f"no progress for {STALL_S:.0f} s: finished {snap.finished}, "
                f"acknowledged {tally.acked_keys} of {tally.rows}"
            )
        if tally.acked_keys >= tally.rows and snap.in_flight == 0:
            account = client.accounting()
            if account["acknowledged"] >= tally.rows and account["awaiting_ack"] == 0:
                settle(node, tally, display)
                return account


def settle(node: DemoNode, tally: Tally, display: Display) -> None:
    """Let the keeper's count of due rows catch up (it counts every second)
    so the last progress line shows none left; bounded by SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        snap = snapshot(node)
        last = snap.due == 0 or time.monotonic() >= deadline
        display.show(snap, tally.acked_keys, last=last)
        if last:
            return
        time.sleep(REFRESH_S)  # a display refresh, not synchronisation


# -- the report -------------------------------------------------------------------------------

LEDGER_ORDER = (
    "received", "routed", "finished", "acknowledged", "discarded", "expired",
    "released", "refused", "in_flight", "awaiting_ack",
)  # fmt: skip


def verdict(account: dict[str, Any], tally: Tally) -> list[str]:
    """What is wrong, one line each; empty when the demo passed."""
    problems = []
    if not account.get("balanced"):
        problems.append("the ledger did not balance")
    if tally.acked_keys != tally.rows:
        problems.append(f"{tally.acked_keys} of {tally.rows} items acknowledged")
    if tally.duplicates:
        problems.append(f"{tally.duplicates} results were offered and acknowledged again")
    if account.get("acknowledged") != tally.rows:
        problems.append(
            f"the ledger counts {account.get('acknowledged')} acknowledged, not {tally.rows}"
        )
    if tally.bad_results:
        problems.append(f"{tally.bad_results} results were not the CPU handler's")
    return problems


def print_report(account: dict[str, Any], tally: Tally, seconds: float, stop_rc: int | None,
                 data_dir: Path) -> bool:  # fmt: skip
    problems = verdict(account, tally)
    if stop_rc != 0:
        problems.append(
            "the node did not stop cleanly"
            + ("" if stop_rc is None else f" (exit status {stop_rc})")
        )
    width = max(len(k) for k in LEDGER_ORDER)
    print()
    print(f"final ledger ({tally.rows} items in {seconds:.1f} s, "
          f"{tally.rows / max(seconds, 1e-9):.0f} items/s):")  # fmt: skip
    for name in LEDGER_ORDER:
        if name in account:
            print(f"  {name:<{width}}  {account[name]}")
    print(
        "  routed = finished + expired + released + in_flight; "
        "finished = acknowledged + discarded + awaiting_ack"
    )
    print(f"balanced: {'yes' if account.get('balanced') else 'NO'}")
    print(
        f"acknowledged exactly once: "
        f"{'yes' if not tally.duplicates and tally.acked_keys == tally.rows else 'NO'} "
        f"({tally.acked_keys} of {tally.rows} items)"
    )
    for line in problems:
        print(f"problem: {line}")
    print(f"data and logs: {data_dir}")
    return not problems


# -- entry --------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    rows = int(getattr(args, "rows", DEFAULT_ROWS) or DEFAULT_ROWS)
    if not 1 <= rows <= MAX_ROWS:
        raise ConfigError(f"--rows {rows} is out of range: allowed 1 to {MAX_ROWS}")
    data_dir = prepare_data_dir(Path(getattr(args, "data_dir", None) or DEFAULT_DATA_DIR))
    config = write_config(data_dir)
    print(f"seeding {rows} rows in {data_dir} …", flush=True)
    seed(data_dir, rows, time.time())
    node = DemoNode(data_dir, config)
    tally = Tally(rows)
    account: dict[str, Any] | None = None
    started = time.monotonic()
    stop_rc: int | None = None
    try:
        node.start()
        print(
            f"node {node.name} at {node.client.base_url}: handler node.handlers:cpu_work, "
            f"{INFERENCE_PROCS} inference processes",
            flush=True,
        )
        with Display(rows) as display:
            account = produce(node, tally, display)
        seconds = time.monotonic() - started
    except KeyboardInterrupt:
        print("interrupted: stopping the node", file=sys.stderr)
        node.close()
        return RET_ERROR
    except (DemoError, NodeError, HarnessError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        node.close()
        return RET_ERROR
    stop_rc = node.close()
    ok = print_report(account, tally, seconds, stop_rc, data_dir)
    return RET_OK if ok else RET_ERROR
