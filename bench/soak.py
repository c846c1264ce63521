"""The soak (issue 5, part 4): a real node under a steady load for a bounded
time, its memory, file descriptors and segment files watched, and its ledger
balanced at the end.

    scripts/soak [--minutes 15] [--rows 20000] [--data-dir DIR] [--seed 1] [--out FILE]

What runs:

- the node: ``python -m node run`` on a fresh data directory (SQLite store
  seeded with ``--rows`` rows before the start), ``--workers 2`` HTTP
  workers, ``--handler node.handlers:cpu_work --inference-procs 1``
  (``QUEUE_NODE_CPU_WORK_ROUNDS`` = ``--cpu-rounds``), 30 s leases. Every
  row has a short cadence (60 to 300 s), so the rows keep coming due again
  and the work never runs out;
- an external consumer (``node.client.Client``: ``POST /claim`` 16 at a
  time, ``POST /complete`` for each lease), competing with the inference
  process;
- a producer polling every job's results (``GET /results``, long poll) and
  acknowledging each one (``POST /jobs/<job>/ack``);
- a writer at ``--write-rate`` operations a second (``POST /rows``,
  ``POST /rows/delete``): 60 % reschedules of live rows, 20 % new rows,
  20 % deletes, so the row count stays where it started.

Every ``--sample-s`` (60 s, or less for a short run: at least 12 samples) it
records, per node process (the pids in ``<data-dir>/node.json``; psutil):
RSS, open file descriptors and threads; the completion log's segment files
under ``<data-dir>/log`` (count, bytes, highest number); the node's shared
memory segments in /dev/shm (size, and bytes resident); ``GET /accounting``;
the keeper's row and due counts from ``GET /queue-state``.

At the end it stops the consumer and the writer, pauses the node
(``POST /admin/pause``: nothing more is granted), waits for quiescence (no
lease in flight, every result acknowledged), reads the ledger, stops the node
(SIGTERM) and prints the report: start against end per process, the segment
files, the throughput, the ledger with its terms, and the verdict.

The verdict (exit 0 when every check passes, 1 otherwise, with one line per
failed check; 2 for bad arguments):

- the ledger balanced at quiescence (``docs/accounting.md``);
- open file descriptors, per process: at the end at most ``FD_TOLERANCE``
  above the most seen over the first third of the run (once warm: an HTTP
  worker opens its store, its ledger connection and its threads at its first
  requests); start and end are reported;
- memory: RSS is reported, but it counts the pages of the shared segments
  (the lease table is 40 MiB at 65,536 slots) as each process touches them,
  so every process that reads the lease table "grows" by up to its size
  while keys spread over its slots: explained, and bounded by the segment's
  size. The check is on private memory (USS, psutil's
  ``memory_full_info``): a process leaks when its USS growth over the last
  third of the run, fitted by least squares, is above ``LEAK_MIB_PER_MIN``
  *and* at least half its rate over the first third: growth that goes on at
  a constant rate. A process that grows while it warms up (imports, caches,
  the keeper's lag ring and flow minutes filling) and then levels off
  passes, with the growth reported;
- segment files bounded: at most ``SEGMENT_FILES_MAX`` at the end (fully
  acknowledged segments are compacted away). A run that never rolled to a
  second segment says that compaction was not exercised;
- no node process restarted and the node stopped cleanly (exit 0).

Machine-readable results go to ``--out`` (default ``<data-dir>/soak.json``).
The data directory stays (``node.log`` has every process's log).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from bench.soak_report import (  # noqa: E402
    FD_TOLERANCE,
    LEAK_MIB_PER_MIN,
    SEGMENT_FILES_MAX,
    MiB,
    analyse,
    print_report,
    segments_check,
    throughput,
    verdict,
)
from node.testing import HarnessError, NodeProcess  # noqa: E402

MARKER = ".queue-node-soak"
# (route, the route's cadence in seconds, job)
ROUTES = (("pages", 120, "soak-pages"), ("listings", 180, "soak-listings"),
          ("feeds", 300, "soak-feeds"))  # fmt: skip
# Row cadences: None takes the route's.
ROW_CADENCES = (None, 60, 120, 180, 300)
LEASE_S = 30
HTTP_WORKERS = 2
INFERENCE_PROCS = 1
CONSUMER_BATCH = 16
POLL_MAX = 500
POLL_WAIT_S = 1.0
# A load thread that fails this many calls in a row stops the soak.
MAX_ERRORS_IN_A_ROW = 50
WRITE_TICKS_PER_S = 10
START_TIMEOUT_S = 120.0
# After the load stops: leases end within a lease (plus the sweep), results
# are acknowledged within a poll.
QUIESCE_TIMEOUT_S = 2 * LEASE_S + 60.0
STOP_TIMEOUT_S = 90.0
MIN_SAMPLES = 12



class SoakError(Exception):
    """The soak could not run to the end."""


# -- the data directory and the node -------------------------------------------------------


def prepare_data_dir(path: Path | None) -> Path:
    """A fresh directory: a new temporary one, one that does not exist or is
    empty, or one a previous soak left (it carries MARKER); never anything else."""
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="qn-soak-"))
    path = path.expanduser()
    if path.exists() and not path.is_dir():
        raise SoakError(f"--data-dir {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        if not (path / MARKER).exists():
            raise SoakError(f"--data-dir {path} is not empty and no soak left it; "
                            "give a fresh directory")  # fmt: skip
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    (path / MARKER).write_text("written by scripts/soak; safe to delete\n")
    return path.resolve()


def write_config(data_dir: Path) -> Path:
    lines = ["# written by scripts/soak", f"lease_s = {LEASE_S}", ""]
    for route, cadence, _job in ROUTES:
        lines += [f"[routes.{route}]", f"cadence_s = {cadence}", ""]
    path = data_dir / "soak.toml"
    path.write_text("\n".join(lines))
    return path


def row_doc(key: str, rnd: random.Random, now: float) -> dict[str, Any]:
    """One row of the soak's schedule: due within a cadence either side of now."""
    route, route_cadence, job = ROUTES[rnd.randrange(len(ROUTES))]
    cadence = ROW_CADENCES[rnd.randrange(len(ROW_CADENCES))]
    span = cadence or route_cadence
    return {"key": key, "route": route, "cadence_s": cadence, "sitemap": rnd.random() < 0.3,
            "due_at": now + rnd.uniform(-span, span), "job": job,
            "payload": {"n": rnd.randrange(1 << 30)}}  # fmt: skip


def seed(data_dir: Path, rows: int, rnd: random.Random, now: float) -> list[str]:
    from node.core.rows import RowWrite
    from node.store import open_store

    keys = [f"soak/{i:08d}" for i in range(rows)]
    store = open_store(f"sqlite:///{data_dir}/schedule.db")
    try:
        for lo in range(0, rows, 5000):
            batch = [RowWrite(**row_doc(k, rnd, now)) for k in keys[lo : lo + 5000]]
            store.upsert(batch, now=now)
    finally:
        store.close()
    return keys


class Node(NodeProcess):
    """``python -m node run`` with the CPU handler (``node.testing``'s
    harness); its output in ``<data-dir>/node.log``."""

    def __init__(self, data_dir: Path, config: Path, workers: int, cpu_rounds: int) -> None:
        super().__init__(
            data_dir, f"soak-{os.getpid()}",
            "--handler", "node.handlers:cpu_work",
            "--inference-procs", str(INFERENCE_PROCS),
            env={"QUEUE_NODE_CPU_WORK_ROUNDS": str(cpu_rounds)},
            config=config, workers=workers, test_hooks=False,
        )  # fmt: skip

    def close(self) -> int | None:
        """SIGTERM, then wait for the drain: the node's exit status (None if
        it had to be killed)."""
        try:
            return self.stop(timeout_s=STOP_TIMEOUT_S)
        except HarnessError:
            return None


# -- the load ------------------------------------------------------------------------------


@dataclass
class Tally:
    """What the load threads did; each field written by one thread."""

    claimed: int = 0
    completed: int = 0
    complete_refused: Counter = field(default_factory=Counter)
    offered: int = 0
    acked: int = 0
    offered_again: int = 0
    upserted: int = 0
    deleted: int = 0
    errors: Counter = field(default_factory=Counter)
    failed: list[str] = field(default_factory=list)


class Load:
    """The three load threads: consumer, producer, writer."""

    def __init__(self, base_url: str, keys: list[str], write_rate: int, seed_value: int) -> None:
        self.base_url = base_url
        self.tally = Tally()
        self.stop_load = threading.Event()  # consumer and writer
        self.stop_producer = threading.Event()
        self.write_rate = write_rate
        self.rnd = random.Random(seed_value * 7919 + 1)
        self.live = list(keys)
        self.next_key = len(keys)
        self._seen_ids: set[int] = set()
        self.threads = [
            threading.Thread(target=self._guard, args=(self._consume, self.stop_load),
                             name="consumer", daemon=True),
            threading.Thread(target=self._guard, args=(self._produce, self.stop_producer),
                             name="producer", daemon=True),
            threading.Thread(target=self._guard, args=(self._write, self.stop_load),
                             name="writer", daemon=True),
        ]  # fmt: skip

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def failed(self) -> list[str]:
        return list(self.tally.failed)

    def _guard(self, body: Any, stop: threading.Event) -> None:
        """Run one thread's loop; a call that fails MAX_ERRORS_IN_A_ROW times
        in a row (or anything unexpected) stops it and is reported."""
        from node.client import Client

        name = threading.current_thread().name
        try:
            with Client(self.base_url) as client:
                body(client, stop)
        except Exception as exc:  # noqa: BLE001 - reported in the verdict
            self.tally.failed.append(f"{name}: {type(exc).__name__}: {exc}")

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """One call; ClientError and OSError are counted and answered None."""
        from node.client import ClientError

        for attempt in range(MAX_ERRORS_IN_A_ROW):
            try:
                return fn(*args, **kw)
            except ClientError as exc:
                self.tally.errors[f"{threading.current_thread().name} {exc.code}"] += 1
                if exc.status < 500:
                    return None
            except OSError as exc:
                self.tally.errors[f"{threading.current_thread().name} {type(exc).__name__}"] += 1
            time.sleep(min(0.05 * (attempt + 1), 1.0))  # backing off a failing call
        raise SoakError(f"{fn.__name__} failed {MAX_ERRORS_IN_A_ROW} times in a row")

    def _consume(self, client: Any, stop: threading.Event) -> None:
        from node.client import ClientError

        t = self.tally
        while not stop.is_set():
            grants = self._call(client.claim, CONSUMER_BATCH, consumer="soak-consumer") or []
            t.claimed += len(grants)
            if not grants:
                stop.wait(0.05)  # nothing ready: pacing, not synchronisation
                continue
            for g in grants:  # every lease in hand is completed, even when stopping
                try:
                    client.complete(g.lease_id, g.key, {"by": "soak", "key": g.key})
                    t.completed += 1
                except ClientError as exc:
                    t.complete_refused[exc.code] += 1
                except OSError as exc:
                    t.errors[f"consumer {type(exc).__name__}"] += 1

    def _produce(self, client: Any, stop: threading.Event) -> None:
        t = self.tally
        while not stop.is_set():
            found = self._call(client.poll, None, max=POLL_MAX, wait_s=POLL_WAIT_S) or []
            by_job: dict[str, list[int]] = {}
            for item in found:
                t.offered += 1
                if item["id"] in self._seen_ids:
                    t.offered_again += 1
                self._seen_ids.add(item["id"])
                by_job.setdefault(item["job"], []).append(item["id"])
            for job, ids in by_job.items():
                t.acked += self._call(client.ack, job, ids) or 0

    def _write(self, client: Any, stop: threading.Event) -> None:
        per_tick = max(1, round(self.write_rate / WRITE_TICKS_PER_S))
        interval = per_tick / self.write_rate
        next_at = time.monotonic()
        while not stop.is_set():
            upserts, deletes = self._write_batch(per_tick, time.time())
            if upserts:
                self.tally.upserted += self._call(client.upsert, upserts) or 0
            if deletes:
                self.tally.deleted += self._call(client.delete, deletes) or 0
            next_at += interval
            stop.wait(max(0.0, next_at - time.monotonic()))  # pacing to the write rate

    def _write_batch(self, n: int, now: float) -> tuple[list[dict], list[str]]:
        """60 % reschedules of live rows, 20 % new rows, 20 % deletes."""
        rnd, live = self.rnd, self.live
        upserts: list[dict] = []
        deletes: list[str] = []
        for _ in range(n):
            r = rnd.random()
            if r < 0.2 and len(live) > 1:
                i = rnd.randrange(len(live))
                live[i], live[-1] = live[-1], live[i]
                deletes.append(live.pop())
            elif r < 0.4:
                key = f"soak/{self.next_key:08d}"
                self.next_key += 1
                live.append(key)
                upserts.append(row_doc(key, rnd, now))
            else:
                upserts.append(row_doc(live[rnd.randrange(len(live))], rnd, now))
        dead = set(deletes)
        return [u for u in upserts if u["key"] not in dead], deletes


# -- sampling ------------------------------------------------------------------------------


def sample_procs(pids: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for role, pid in pids.items():
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                mem = p.memory_full_info()
                out[role] = {"pid": pid, "rss": mem.rss, "uss": mem.uss, "shared": mem.shared,
                             "fds": p.num_fds(), "threads": p.num_threads()}  # fmt: skip
        except psutil.Error as exc:
            out[role] = {"pid": pid, "error": type(exc).__name__}
    return out


def sample_log(data_dir: Path) -> dict[str, Any]:
    files = sorted((data_dir / "log").glob("*.seg"))
    sizes = []
    for f in files:
        try:
            sizes.append(f.stat().st_size)
        except FileNotFoundError:  # compacted between the listing and the stat
            continue
    numbers = [int(f.stem) for f in files if f.stem.isdigit()]
    return {"files": len(sizes), "bytes": sum(sizes), "highest": max(numbers, default=0)}


def sample_shm(name: str) -> dict[str, Any]:
    out = {}
    for path in sorted(Path("/dev/shm").glob(f"queue-node.{name}.*")):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        out[path.name] = {"size": st.st_size, "resident": st.st_blocks * 512}
    return out


def take_sample(node: Node, client: Any, t0: float) -> dict[str, Any]:
    from node.client import ClientError

    doc: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 2)}
    doc["procs"] = sample_procs(node.pids_by_role())
    doc["log"] = sample_log(node.data_dir)
    doc["shm"] = sample_shm(node.name)
    try:
        doc["accounting"] = client.accounting()
        state = client.queue_state()
    except (ClientError, OSError) as exc:
        doc["error"] = str(exc)
        return doc
    now = state.get("now") or {}
    doc["state"] = {"vouched": (state.get("trust") or {}).get("vouched"),
                    "rows": now.get("rows"), "due": (now.get("due") or {}).get("total"),
                    "in_flight": now.get("in_flight")}  # fmt: skip
    return doc


# -- the end -------------------------------------------------------------------------------


def quiesce(node: Node, client: Any, load: Load) -> dict[str, Any]:
    """Stop the consumer and the writer, pause the node, and wait until no
    lease is in flight and every result is acknowledged (the producer acks
    on). The ledger then, and how long it took."""
    load.stop_load.set()
    for t in load.threads:
        if t.name != "producer":
            t.join(timeout=30)
    t0 = time.monotonic()
    client.pause()
    deadline = t0 + QUIESCE_TIMEOUT_S
    account = client.accounting()
    while account["in_flight"] or account["awaiting_ack"]:
        node.check_alive()
        if time.monotonic() >= deadline or load.failed():
            break
        time.sleep(0.2)  # polling the ledger to a deadline
        account = client.accounting()
    reached = not account["in_flight"] and not account["awaiting_ack"]
    load.stop_producer.set()
    for t in load.threads:
        t.join(timeout=POLL_WAIT_S + 30)
    if reached:
        account = client.accounting()  # after the producer's last poll
    return {"reached": reached, "waited_s": round(time.monotonic() - t0, 2),
            "accounting": account}  # fmt: skip


# -- entry ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--data-dir", type=Path, default=None, help="default: a new temporary one")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="default: <data-dir>/soak.json")
    p.add_argument("--write-rate", type=int, default=200, help="row writes a second")
    p.add_argument("--sample-s", type=float, default=None,
                   help=f"default: 60, or less so that there are {MIN_SAMPLES} samples")
    p.add_argument("--workers", type=int, default=HTTP_WORKERS, help="the node's HTTP workers")
    p.add_argument("--cpu-rounds", type=int, default=500,
                   help="SHA-256 rounds a result of the CPU handler")
    args = p.parse_args(argv)
    if not 0 < args.minutes <= 24 * 60:
        p.error("--minutes must be above 0 and at most a day")
    if not 100 <= args.rows <= 1_000_000:
        p.error("--rows must be from 100 to 1,000,000")
    if not 1 <= args.write_rate <= 10_000:
        p.error("--write-rate must be from 1 to 10,000")
    if args.sample_s is None:
        args.sample_s = min(60.0, args.minutes * 60 / MIN_SAMPLES)
    return args


def run_load(
    node: Node, client: Any, load: Load, args: argparse.Namespace, t0: float
) -> list[dict]:
    """Samples every sample_s until the duration is over (or the load fails)."""
    samples = [take_sample(node, client, t0)]
    load.start()
    end = t0 + args.minutes * 60
    next_at = t0 + args.sample_s
    while True:
        node.check_alive()
        if load.failed():
            break
        now = time.monotonic()
        if now >= next_at or now >= end:
            samples.append(take_sample(node, client, t0))
            s = samples[-1]
            a = s.get("accounting") or {}
            print(f"[{s['t_s'] / 60:5.1f} min] finished {a.get('finished')} acked "
                  f"{a.get('acknowledged')} in_flight {a.get('in_flight')} rows "
                  f"{(s.get('state') or {}).get('rows')} segments {s['log']['files']} "
                  f"({s['log']['bytes'] / MiB:.1f} MiB)", flush=True)
            next_at += args.sample_s
            if now >= end:
                return samples
        time.sleep(min(1.0, max(0.0, min(next_at, end) - time.monotonic())))  # pacing


def build_report(args: argparse.Namespace, node: Node, samples: list[dict], quiet: dict,
                 load: Load, stop_rc: int | None, out: Path) -> dict[str, Any]:  # fmt: skip
    duration_s = samples[-1]["t_s"] - samples[0]["t_s"]
    s0, s1 = samples[0].get("state") or {}, samples[-1].get("state") or {}
    tally = load.tally
    report = {
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "name": node.name, "data_dir": str(node.data_dir), "out": str(out),
        "duration_s": duration_s,
        "processes": analyse(samples, duration_s),
        "segments": segments_check(samples),
        "shm_end": samples[-1]["shm"],
        "live_data": {"rows_start": s0.get("rows"), "rows_end": s1.get("rows"),
                      "due_start": s0.get("due"), "due_end": s1.get("due")},
        "throughput": throughput(samples, duration_s),
        "load": {"claimed": tally.claimed, "completed": tally.completed,
                 "complete_refused": dict(tally.complete_refused), "offered": tally.offered,
                 "acked": tally.acked, "offered_again": tally.offered_again,
                 "upserted": tally.upserted, "deleted": tally.deleted,
                 "errors": dict(tally.errors), "failed": load.failed()},
        "quiescence": {k: v for k, v in quiet.items() if k != "accounting"},
        "ledger": quiet["accounting"],
        "stop_rc": stop_rc,
        "thresholds": {"fd_tolerance": FD_TOLERANCE, "leak_mib_per_min": LEAK_MIB_PER_MIN,
                       "segment_files_max": SEGMENT_FILES_MAX},
        "samples": samples,
    }  # fmt: skip
    report["problems"] = verdict(report, QUIESCE_TIMEOUT_S)
    report["ok"] = not report["problems"]
    return report


def main(argv: list[str] | None = None) -> int:
    from node.client import Client

    args = parse_args(argv)
    try:
        data_dir = prepare_data_dir(args.data_dir)
    except SoakError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    out = args.out or data_dir / "soak.json"
    rnd = random.Random(args.seed)
    print(f"seeding {args.rows} rows in {data_dir} …", flush=True)
    keys = seed(data_dir, args.rows, rnd, time.time())
    node = Node(data_dir, write_config(data_dir), args.workers, args.cpu_rounds)
    stop_rc: int | None = None
    try:
        node.start(timeout_s=START_TIMEOUT_S)
        print(f"node {node.name} at {node.base_url}, pids {node.pids_by_role()}; "
              f"load for {args.minutes:g} min, a sample every {args.sample_s:g} s", flush=True)
        load = Load(node.base_url, keys, args.write_rate, args.seed)
        with Client(node.base_url) as client:
            t0 = time.monotonic()
            samples = run_load(node, client, load, args, t0)
            quiet = quiesce(node, client, load)
            quiet_sample = take_sample(node, client, t0)
        stop_rc = node.close()
    except (SoakError, HarnessError, OSError) as exc:
        print(f"soak failed: {exc}", file=sys.stderr)
        node.close()
        return 1
    except KeyboardInterrupt:
        print("interrupted: stopping the node", file=sys.stderr)
        node.close()
        return 1
    report = build_report(args, node, samples, quiet, load, stop_rc, out)
    report["after_quiescence"] = quiet_sample
    out.write_text(json.dumps(report, indent=1, default=str))
    print_report(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
