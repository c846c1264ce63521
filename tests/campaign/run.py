"""One campaign, start to verdict: ``python -m tests.campaign.run --seed N ...``.

1. Start a node (``--inference-procs 2`` running ``tests.campaign.handler:work``,
   short leases and offer timeout so the windows open within a short run).
2. Start the producer, the outside consumer and the receiver; run the
   nemesis's schedule while they work.
3. Heal: disk faults off, stopped processes continued, the node running.
   Wait for the queue to drain (every written item acknowledged) or a deadline.
4. Read everything (the logs, the table, ``GET /accounting``, the node's log),
   stop the node, and check.

A failing run prints its seed and the command that reruns it.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sqlite3
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.testing import NodeProcess, cleanup_segments, wait_for
from tests.campaign import checker
from tests.campaign.nemesis import Nemesis, mount_tmpfs, schedule, umount
from tests.campaign.workload import (
    CADENCE_S,
    EventLog,
    Outside,
    Producer,
    Receiver,
    item_of,
    read_log,
)

LEASE_S = 4
OFFER_TIMEOUT_S = 3
HANDLER = "tests.campaign.handler:work"
# Simulated device time per item inside the node: the outside consumer's
# claims over HTTP then win a share of the items.
WORK_S = 0.05
# --tmpfs: big enough for a campaign's results, small enough to fill at once.
TMPFS_SIZE = "4m"


@dataclass
class Settings:
    seed: int = 1
    items: int = 300
    actions: int = 12
    tmpfs: bool = False
    drain_s: float = 90.0
    workdir: Path | None = None  # kept after the run when given
    pause_s: tuple[float, float] = (1.0, 3.0)

    def command(self) -> str:
        flags = f"--seed {self.seed} --items {self.items} --actions {self.actions}"
        return "scripts/campaign " + flags + (" --tmpfs" if self.tmpfs else "")


@dataclass
class Outcome:
    verdict: checker.Verdict
    faults: list[dict[str, Any]]
    workdir: Path
    elapsed_s: float


def _read_table(db: Path) -> dict[str, float]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return {k: due for k, due in conn.execute("SELECT key, due_at FROM schedule")}
    finally:
        conn.close()


def _drained(receiver: Receiver, producer: Producer, db: Path, deadline_s: float) -> bool:
    """Every row of ours in the table acknowledged (maybe-written ones included)."""

    def all_acked() -> bool:
        if not producer.done.is_set():
            return False
        ours = {item_of(k) for k in _read_table(db)} - {None}
        acked_items = {item_of(k) for k in receiver.acked_keys()}
        return ours <= acked_items

    try:
        wait_for(all_acked, deadline_s, "every written item acknowledged")
        return True
    except AssertionError:
        return False


def _settled_accounting(node: NodeProcess, deadline_s: float = 30.0) -> dict[str, Any]:
    """/accounting once nothing is in flight or awaiting an ack and it
    balances; the last answer at the deadline."""
    last: dict[str, Any] = {}

    def quiet() -> bool:
        try:
            status, doc = node.request("GET", "/accounting", timeout_s=5)
        except OSError:
            return False
        if status == 200:
            last.clear()
            last.update(doc)
        return (
            bool(last) and last["balanced"] and not last["in_flight"] and not last["awaiting_ack"]
        )

    try:
        wait_for(quiet, deadline_s, "/accounting settled")
    except AssertionError:
        pass
    return last


def _node(work: Path, name: str, control: Path) -> NodeProcess:
    env = {"QUEUE_NODE_TEST_LOG_FAULTS": str(control),
           "QUEUE_NODE_OFFER_TIMEOUT_S": str(OFFER_TIMEOUT_S),
           "QUEUE_NODE_DRAIN_TIMEOUT_S": "10",
           "QN_CAMPAIGN_RUNS": str(work / "runs.jsonl"),
           "QN_CAMPAIGN_WORK_S": str(WORK_S)}  # fmt: skip
    return NodeProcess(work / "data", name, "--handler", HANDLER, "--inference-procs", "2",
                       "--lease-s", str(LEASE_S), env=env)  # fmt: skip


def run(s: Settings) -> Outcome:
    """The whole campaign; the node is killed and its segments removed at the
    end whatever happens."""
    work = s.workdir or Path(tempfile.mkdtemp(prefix="qn-campaign-"))
    work.mkdir(parents=True, exist_ok=True)
    name = f"camp-{uuid.uuid4().hex[:8]}"
    control = work / "log-faults"
    control.write_text("")
    fs = None
    if s.tmpfs:
        why = mount_tmpfs(work / "data" / "log", TMPFS_SIZE)
        if why:
            raise RuntimeError(f"--tmpfs: {why}")
        fs = work / "data" / "log"
    node = _node(work, name, control)
    print(f"campaign seed={s.seed} items={s.items} actions={s.actions} workdir={work}",
          flush=True)  # fmt: skip
    print("rerun: " + s.command(), flush=True)
    try:
        return _campaign(s, node, work, control, fs)
    finally:
        if node.proc is not None and node.proc.poll() is None:
            node.kill()
        cleanup_segments(name)
        if fs is not None:
            umount(fs)


def _campaign(
    s: Settings, node: NodeProcess, work: Path, control: Path, fs: Path | None
) -> Outcome:
    started = time.monotonic()
    rng = random.Random(s.seed)
    data = work / "data"
    logs = {k: EventLog(work / f"{k}.jsonl") for k in ("producer", "consumer", "nemesis")}
    actions = schedule(s.seed, s.actions, s.pause_s)
    # The load lasts through most of the schedule: faults land mid-load.
    load_s = max(5.0, 0.6 * sum(a.pause_s + 2 for a in actions))
    node.start(timeout_s=60)
    producer = Producer(data, logs["producer"], s.items, load_s)
    outside = Outside(data, logs["consumer"], random.Random(rng.random()), LEASE_S)
    receiver = Receiver(data, logs["consumer"], random.Random(rng.random()))
    threads = [producer, outside, receiver]
    for t in threads:
        t.start()
    nemesis = Nemesis(node, logs["nemesis"], control, lambda: not producer.done.is_set(), fs)
    try:
        nemesis.run(actions)
    finally:
        nemesis.heal()
    drained = _drained(receiver, producer, data / "schedule.db", s.drain_s)
    for t in threads:
        t.finish()
    accounting = _settled_accounting(node)
    table = _read_table(data / "schedule.db")
    ended_at = time.time()
    rc = node.stop(timeout_s=60)
    for log in logs.values():
        log.close()
    faults = [r for r in read_log(work / "nemesis.jsonl") if r["ev"] == "fault"]
    verdict = checker.check(checker.Evidence(
        producer=read_log(work / "producer.jsonl"),
        consumer=read_log(work / "consumer.jsonl"),
        runs=read_log(work / "runs.jsonl"),
        table=table,
        accounting=accounting,
        faults=faults,
        node_events=checker.parse_node_log(node.log_path.read_text(errors="replace")),
        offer_timeout_s=OFFER_TIMEOUT_S,
        ended_at=ended_at,
        cadence_s=CADENCE_S,
    ))  # fmt: skip
    verdict.problems += [f"the {t.name} thread died: {t.error!r}" for t in threads if t.error]
    if not drained:
        verdict.problems.append(f"not drained within {s.drain_s} s")
    if rc != 0:
        verdict.problems.append(f"the final clean stop exited {rc}")
    missing = {a.kind for a in actions} - {f["kind"] for f in faults}
    if missing:
        verdict.problems.append(f"scheduled faults that never ran: {sorted(missing)}")
    return Outcome(verdict, faults, work, time.monotonic() - started)


def report(s: Settings, out: Outcome) -> str:
    kinds: dict[str, int] = {}
    for f in out.faults:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    lines = [
        f"seed {s.seed}: {len(out.faults)} faults in {out.elapsed_s:.0f} s: "
        + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())),
        out.verdict.table(),
    ]
    if not out.verdict.ok:
        lines.append(
            f"FAILED with seed {s.seed}; evidence kept in {out.workdir}; rerun: {s.command()}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/campaign", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    p.add_argument("--items", type=int, default=2000)
    p.add_argument("--actions", type=int, default=30)
    p.add_argument(
        "--tmpfs",
        action="store_true",
        help="a real 4 MiB tmpfs under the completion log, filled for enospc",
    )
    p.add_argument("--drain-s", type=float, default=180.0)
    p.add_argument("--keep", type=Path, help="work directory, kept after the run")
    args = p.parse_args(argv)
    s = Settings(seed=args.seed, items=args.items, actions=args.actions, tmpfs=args.tmpfs,
                 drain_s=args.drain_s, workdir=args.keep)  # fmt: skip
    out = run(s)
    print(report(s, out), flush=True)
    if args.keep is None and out.verdict.ok:
        shutil.rmtree(out.workdir, ignore_errors=True)
    return 0 if out.verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
