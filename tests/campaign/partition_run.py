"""One partition campaign, start to verdict:
``python -m tests.campaign.partition_run --seed N --actions N [--nodes 3]``
(``scripts/partition-campaign``; docs/reliability.md, "Partitions").

1. A per-run PostgreSQL database on the test server (created here, dropped
   at the end), a bridge and a namespace per node (tests/netns.py), and
   ``--nodes`` nodes over it, each with one inference process running
   ``tests.campaign.handler:work``, short leases, a 4 s membership timeout.
2. The producer (writes through any node), the outside GPU consumer (claims
   on each node in turn, completes where it claimed), the receiver (polls
   the fleet's results through any node, acks) and the cluster poller
   (``GET /queue-state?scope=cluster``, every answer judged) run while the
   nemesis plays the seed's schedule (tests/campaign/partition_nemesis.py).
3. Heal: every cut healed, every node running, ready and live. Wait for
   every written item to be acknowledged, then for every keeper to hold
   exactly its rendezvous share, and the books to settle.
4. Check (tests/campaign/partition_checker.py) and print the actions, the
   figures and the verdict. A failing run prints its seed and the command
   that reruns it.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.store.postgres import PostgresStore
from node.testing import cleanup_segments, wait_for
from tests import pg
from tests.campaign import checker
from tests.campaign.partition_checker import FleetEvidence, check_fleet, judge_faults
from tests.campaign.partition_fleet import (
    LEASE_S,
    OFFER_TIMEOUT_S,
    TIMEOUT_S,
    ClusterPoller,
    Fleet,
    FleetEndpoint,
    FleetOutside,
    FleetReceiver,
)
from tests.campaign.partition_nemesis import LEASE_CUT_LEASE_S, PartitionNemesis, schedule
from tests.campaign.workload import CADENCE_S, EventLog, Producer, item_of, read_log
from tests.netns import Net

# What one action takes besides its pause and hold: the heal, a restart,
# the rejoin's handover hold (one membership timeout), on two shared cores.
ACTION_S = 14.0
HEAL_S = 120.0  # every node back after an action, at most


@dataclass
class Settings:
    seed: int = 1
    actions: int = 10
    nodes: int = 3
    items: int = 800
    drain_s: float = 150.0
    workdir: Path | None = None  # kept after the run when given
    pause_s: tuple[float, float] = (1.0, 3.0)

    def command(self) -> str:
        return (f"scripts/partition-campaign --seed {self.seed} --actions {self.actions} "
                f"--nodes {self.nodes} --items {self.items}")  # fmt: skip


@dataclass
class Outcome:
    verdict: checker.Verdict
    faults: list[dict[str, Any]]
    workdir: Path
    elapsed_s: float
    figures: dict[str, Any] = field(default_factory=dict)


def run(s: Settings) -> Outcome:
    """The whole campaign; the nodes are killed, their segments removed,
    the namespaces and the database dropped at the end, whatever happens."""
    work = s.workdir or Path(tempfile.mkdtemp(prefix="qn-partition-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"partition campaign seed={s.seed} actions={s.actions} nodes={s.nodes} "
          f"items={s.items} workdir={work}", flush=True)  # fmt: skip
    print("rerun: " + s.command(), flush=True)
    db_url = pg.create_database()
    try:
        PostgresStore(db_url).close()  # the schema, once, before the nodes race for it
        with Net(pg.SERVER) as net:
            tag = uuid.uuid4().hex[:6]
            names = [f"pc{tag}-{i}" for i in range(s.nodes)]
            fleet = Fleet(net, db_url, work, names, f"fleet-{uuid.uuid4().hex}", {})
            try:
                return _campaign(s, fleet, work)
            finally:
                for i, name in enumerate(names):
                    if fleet.running(i):
                        fleet.kill(i)
                    cleanup_segments(name)
                fleet.close_db()
    finally:
        pg.drop_database(db_url)


def _drained(fleet: Fleet, receiver: FleetReceiver, producer: Producer, deadline_s: float) -> bool:
    def all_acked() -> bool:
        if not producer.done.is_set():
            return False
        ours = {item_of(k) for k in fleet.table()} - {None}
        return ours <= {item_of(k) for k in receiver.acked_keys()}

    try:
        wait_for(all_acked, deadline_s, "every written item acknowledged")
        return True
    except AssertionError:
        return False


def _settled_books(fleet: Fleet, deadline_s: float = 60.0) -> tuple[dict, dict]:
    """Each node's ``/accounting`` and the fleet's, once every one balances
    with nothing in flight or awaiting an ack; the last answers at the
    deadline."""
    books: dict[str, dict] = {n: {} for n in fleet.names}
    cluster: dict[str, Any] = {}

    def quiet() -> bool:
        ok = True
        for i, name in enumerate(fleet.names):
            try:
                status, doc = fleet.nodes[i].request("GET", "/accounting", headers=fleet.auth,
                                                     timeout_s=5)  # fmt: skip
            except OSError:
                return False
            if status == 200:
                books[name] = doc
            ok = ok and bool(books[name]) and books[name]["balanced"]
            ok = ok and not books[name].get("in_flight") and not books[name].get("awaiting_ack")
        try:
            status, doc = fleet.nodes[0].request("GET", "/accounting?scope=cluster",
                                                 headers=fleet.auth, timeout_s=10)  # fmt: skip
        except OSError:
            return False
        if status == 200:
            cluster.clear()
            cluster.update(doc)
        return ok and status == 200 and bool(doc.get("balanced"))

    try:
        wait_for(quiet, deadline_s, "every node's books settled")
    except AssertionError:
        pass
    return books, cluster


def _input_gaps(fleet: Fleet, since: float, deadline_s: float = 30.0) -> dict[str, Any]:
    """Each keeper's ``counters.input_gap`` from counts taken after ``since``."""
    gaps: dict[str, Any] = {}

    def fresh() -> bool:
        for i, name in enumerate(fleet.names):
            counters = fleet.state(i).get("counters") or {}
            if counters.get("at", 0) <= since + fleet.skews[i]:  # on the node's own clock
                return False
            gaps[name] = counters.get("input_gap")
        return True

    try:
        wait_for(fresh, deadline_s, "counts taken after the heal")
    except AssertionError:
        for name in fleet.names:
            gaps.setdefault(name, "no count after the heal")
    return gaps


def _final_cluster_state(fleet: Fleet, deadline_s: float = 30.0) -> list[str]:
    """After the drain: a 200 whose rows and due rows are the table's."""
    seen: list[Any] = []

    def exact() -> bool:
        status, doc = fleet.nodes[-1].request("GET", "/queue-state?scope=cluster",
                                              headers=fleet.auth, timeout_s=10)  # fmt: skip
        rows, due = fleet.row_counts(time.time())
        seen[:] = [status, (doc.get("now") or {}) if isinstance(doc, dict) else doc, rows, due]
        if status != 200:
            return False
        now = doc["now"]
        return now["rows"] == rows and now["due"]["total"] == due

    try:
        wait_for(exact, deadline_s, "the cluster's state exact after the drain")
        return []
    except AssertionError:
        return [f"the cluster's state after the drain is not the table's: {seen}"]


def _campaign(s: Settings, fleet: Fleet, work: Path) -> Outcome:
    started = time.monotonic()
    rng = random.Random(s.seed)
    actions = schedule(s.seed, s.actions, s.nodes, TIMEOUT_S, s.pause_s)
    logs = {k: EventLog(work / f"{k}.jsonl")
            for k in ("producer", "consumer", "nemesis", "poller")}  # fmt: skip
    for i in range(s.nodes):
        fleet.start(i, wait_ready=False)
    fleet.wait_all_back(HEAL_S)
    print(f"fleet up in {time.monotonic() - started:.0f} s: {fleet.names}", flush=True)
    dirs = [n.data_dir for n in fleet.nodes]
    load_s = max(10.0, 0.5 * sum(a.pause_s + a.hold_s + ACTION_S for a in actions))
    producer = Producer(dirs[0], logs["producer"], s.items, load_s)
    producer.endpoint = FleetEndpoint(dirs, fleet.token)  # type: ignore[assignment]
    outside = FleetOutside(dirs, fleet.names, fleet.token, logs["consumer"],
                           random.Random(rng.random()), LEASE_S)  # fmt: skip
    receiver = FleetReceiver(dirs, fleet.token, logs["consumer"], random.Random(rng.random()))
    poller = ClusterPoller(fleet, logs["poller"])
    threads = [producer, outside, receiver]
    for t in [*threads, poller]:
        t.start()
    nemesis = PartitionNemesis(fleet, logs["nemesis"], logs["consumer"], HEAL_S)
    try:
        nemesis.run(actions)
    finally:
        nemesis.heal()
    healed_at = time.monotonic()
    drained = _drained(fleet, receiver, producer, s.drain_s)
    drained_s = time.monotonic() - healed_at
    for t in threads:
        t.finish()
        t.endpoint.close()  # every node's client, not only the last one used
    problems: list[str] = []
    table = fleet.table()
    why: list[str] = []
    try:
        wait_for(lambda: fleet.exact(sorted(table), why), 90, "every row held by its owner")
    except AssertionError:
        problems.append(f"after the heal the keepers do not hold the rendezvous shares: {why}")
    books, cluster = _settled_books(fleet)
    since = time.time()
    gaps = _input_gaps(fleet, since)
    problems += _final_cluster_state(fleet)
    poller.finish()
    ended_at = time.time()
    numbers = fleet.numbers()
    events = {name: fleet.log_events(i) for i, name in enumerate(fleet.names)}
    for i in range(s.nodes):
        rc = fleet.stop(i)
        if rc != 0:
            problems.append(f"{fleet.names[i]}: the final clean stop exited {rc}")
    for log in logs.values():
        log.close()
    faults = [r for r in read_log(work / "nemesis.jsonl") if r["ev"] == "fault"]
    problems += judge_faults(faults, TIMEOUT_S)
    problems += [f"cluster state: {p}" for p in poller.bad[:20]]
    if poller.error is not None:
        problems.append(f"the cluster poller died: {poller.error!r}")
    problems += [f"the {t.name} thread died: {t.error!r}" for t in threads if t.error]
    if not drained:
        problems.append(f"not drained within {s.drain_s} s")
    missing = {a.kind for a in actions} - {f["kind"] for f in faults}
    if missing:
        problems.append(f"scheduled actions that never ran: {sorted(missing)}")
    verdict = check_fleet(FleetEvidence(
        producer=read_log(work / "producer.jsonl"),
        consumer=read_log(work / "consumer.jsonl"),
        runs=read_log(work / "runs.jsonl"),
        table=table, accounting=books, cluster_accounting=cluster, input_gaps=gaps,
        numbers=numbers, node_events=events, faults=faults, live_changes=poller.changes,
        offer_timeout_s=OFFER_TIMEOUT_S, lease_s_max=LEASE_CUT_LEASE_S + 5,
        ended_at=ended_at, cadence_s=CADENCE_S, extra_problems=problems,
    ))  # fmt: skip
    figures = _figures(faults, poller, drained_s)
    figures["books"] = {n: {k: b.get(k) for k in ("received", "requeued", "routed", "waiting",
                                                   "withdrawn", "finished", "expired",
                                                   "released", "in_flight", "balanced")}
                        for n, b in books.items()}  # fmt: skip
    figures["input_gaps"] = gaps
    return Outcome(verdict, faults, work, time.monotonic() - started, figures)


def _figures(faults: list[dict[str, Any]], poller: ClusterPoller, drained_s: float) -> dict:
    refused = [f["refused_s"] for f in faults if f.get("refused_s") is not None]
    out = [f["out_s"] for f in faults if f.get("out_s") is not None]

    def spread(xs: list[float]) -> str:
        if not xs:
            return "-"
        return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f} (n={len(xs)})"

    return {
        "cut -> refused not_granting (min/median/max s)": spread(refused),
        "cut -> out of the live list (min/median/max s)": spread(out),
        "cluster polls 200 / 503 / no answer": "{} / {} / {}".format(
            poller.counts["200"], poller.counts["503"], poller.counts["no answer"]),
        "live-list changes seen": len(poller.changes) - 1,
        "heal -> drained (s)": round(drained_s, 1),
    }


def report(s: Settings, out: Outcome) -> str:
    lines = [f"seed {s.seed}: {len(out.faults)} actions on {s.nodes} nodes in "
             f"{out.elapsed_s:.0f} s", "", "actions:"]  # fmt: skip
    t0 = out.faults[0]["t0"] if out.faults else 0.0
    keys = ("refused_s", "out_s", "live_at_refusal", "probe_grants", "change_seen_s",
            "reported_skew_s", "leases", "completions", "all_live", "error")  # fmt: skip
    for f in out.faults:
        a = f.get("action") or {}
        what = f["kind"] + (f" {a.get('way')}" if a.get("way") else "") + (
            f" {a.get('change')}" if a.get("change") else "")
        other = a.get("other", -1)
        extra = " ".join(f"{k}={f[k]}" for k in keys if k in f)
        hold = f" hold {a['hold_s']:.1f}s" if a.get("hold_s") else ""
        skew = f" skew {a['skew_s']:+.1f}s" if a.get("skew_s") else ""
        lines.append(f"  +{f['t0'] - t0:6.1f}s {f['t1'] - f['t0']:5.1f}s  {what:<22} "
                     f"n{a.get('node')}{'' if other < 0 else f' (n{other})'}{hold}{skew}"
                     f"  {extra}")  # fmt: skip
    lines += ["", "figures:"]
    for k, v in out.figures.items():
        if k == "books":
            for n, b in v.items():
                lines.append(f"  books {n}: {b}")
        else:
            lines.append(f"  {k}: {v}")
    lines += ["", out.verdict.table()]
    if not out.verdict.ok:
        lines.append(
            f"FAILED with seed {s.seed}; evidence kept in {out.workdir}; rerun: {s.command()}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/partition-campaign",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    p.add_argument("--actions", type=int, default=10)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--items", type=int, default=800)
    p.add_argument("--drain-s", type=float, default=150.0)
    p.add_argument("--keep", type=Path, help="work directory, kept after the run")
    args = p.parse_args(argv)
    s = Settings(seed=args.seed, actions=args.actions, nodes=args.nodes, items=args.items,
                 drain_s=args.drain_s, workdir=args.keep)  # fmt: skip
    out = run(s)
    print(report(s, out), flush=True)
    if args.keep is None and out.verdict.ok:
        shutil.rmtree(out.workdir, ignore_errors=True)
    return 0 if out.verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
