"""The partition campaign's nemesis: a seeded schedule of network cuts,
kills, restarts and clock skews against a fleet in network namespaces
(docs/reliability.md, "Partitions").

``schedule(seed, n, nodes, timeout_s)`` is a pure function of its
arguments: the same seed gives the same actions (kind, target node, the
other node involved, pauses, holds, skews), so a failing run is rerun by
its seed. When ``n`` is at least the number of kinds every kind comes at
least once (a shuffled round of all kinds, then random picks).

The kinds (every cut is healed at the end of its action, which is logged
as a ``heal`` of its own):

- ``cut_db``: the target cut off from the database, both ways, for 1.6 to
  2.5 membership timeouts: it stops granting, lapses, its rows move; the
  action measures cut -> a claim refused ``not_granting`` and cut -> out of
  the database's live list;
- ``blip_db``: the same for 0.1 to 0.5 timeouts: it should not lapse;
- ``cut_peers``: the target cut off from every other node (the database
  reachable from all): membership does not change;
- ``one_way``: one direction only, between the target and the database or
  a peer (``way`` says which side drops: ``to``, the target's packets
  vanish; ``from``, the other's do);
- ``lease_cut``: the nemesis claims leases on the target (long leases),
  cuts it from the database until it lapses, heals, and completes them on
  the target after it rejoined: leases held across a cut;
- ``kill``: kill -9 the target (every process), down 1 to 3 s, restarted;
- ``kill_in_change``: a membership change by another node (``change``:
  ``lapse``, it is cut from the database until it drops out of the list;
  ``join``, it stops cleanly and starts again), and the target killed -9
  the moment the database's live list shows the change; then both back;
- ``skew``: the target restarted with its wall clock (``time.time``) off
  by ``skew_s`` (a sitecustomize on its PYTHONPATH); it keeps that skew
  until the end. Its ``trust.membership.skew_s`` must report it.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tests.campaign.workload import EventLog

if TYPE_CHECKING:
    from tests.campaign.partition_fleet import Fleet

KINDS = (
    "cut_db",
    "blip_db",
    "cut_peers",
    "one_way",
    "lease_cut",
    "kill",
    "kill_in_change",
    "skew",
)
# The kinds after which a node's rows have moved (its membership lapsed or
# it died): the evidence "Two nodes, one key" asks for.
MOVES = ("cut_db", "one_way", "lease_cut", "kill", "kill_in_change", "skew")
LEASE_CUT_LEASES = 4
LEASE_CUT_LEASE_S = 60.0  # outlives the cut, the lapse and the rejoin
LEASE_CUT_TRY_S = 10.0  # claiming them, while the consumers race for the same rows
SKEW_S = (2.0, 6.0)  # |offset| of a skewed clock; a sign drawn too


@dataclass(frozen=True)
class PAction:
    kind: str
    node: int  # the target, an index into the fleet
    other: int  # the other node involved (-1: the database, or none)
    pause_s: float  # before the action
    hold_s: float  # how long the cut (or the kill) lasts
    way: str = ""  # one_way: "to" (the target's packets dropped) or "from"
    change: str = ""  # kill_in_change: "lapse" or "join"
    skew_s: float = 0.0  # skew: the target's clock offset

    def describe(self) -> str:
        parts = [self.kind, f"n{self.node}"]
        if self.kind == "one_way":
            parts.append(f"{self.way} {'db' if self.other < 0 else f'n{self.other}'}")
        elif self.kind == "kill_in_change":
            parts.append(f"{self.change} of n{self.other}")
        elif self.kind == "skew":
            parts.append(f"{self.skew_s:+.1f}s")
        return " ".join(parts)


def schedule(
    seed: int,
    n: int,
    nodes: int = 3,
    timeout_s: float = 4.0,
    pause_s: tuple[float, float] = (1.0, 3.0),
) -> list[PAction]:
    """The seed's actions (module docstring)."""
    if nodes < 2:
        raise ValueError("a partition campaign needs at least two nodes")
    rng = random.Random(seed)
    kinds: list[str] = []
    if n >= len(KINDS):
        kinds = list(KINDS)
        rng.shuffle(kinds)
    kinds += [rng.choice(KINDS) for _ in range(n - len(kinds))]
    kinds = kinds[:n]
    out = []
    for kind in kinds:
        node = rng.randrange(nodes)
        other = rng.choice([i for i in range(nodes) if i != node])
        pause = round(rng.uniform(*pause_s), 2)
        way = change = ""
        skew = 0.0
        if kind in ("cut_db", "lease_cut"):
            hold = rng.uniform(1.6, 2.5) * timeout_s
        elif kind == "blip_db":
            hold = rng.uniform(0.1, 0.5) * timeout_s
        elif kind == "cut_peers":
            hold = rng.uniform(1.0, 2.5) * timeout_s
        elif kind == "one_way":
            hold = rng.uniform(1.6, 2.5) * timeout_s
            way = rng.choice(("to", "from"))
            if rng.random() < 0.5:
                other = -1  # the database
        elif kind == "kill":
            hold = rng.uniform(1.0, 3.0)
        elif kind == "kill_in_change":
            hold = rng.uniform(1.0, 3.0)
            change = rng.choice(("lapse", "join"))
        else:  # skew
            hold = 0.0
            skew = round(rng.choice((-1, 1)) * rng.uniform(*SKEW_S), 2)
        if kind not in ("one_way", "kill_in_change"):
            other = -1  # the database, or every peer (cut_peers)
        out.append(PAction(kind, node, other, pause, round(hold, 2), way, change, skew))
    return out


class PartitionNemesis:
    """Runs a schedule against a ``Fleet`` (tests/campaign/partition_fleet.py).

    Each action is logged (``fault``, with ``t0``/``t1`` and what it
    measured) and printed; after each the nemesis waits until every node is
    back: running, ready and live in the database's list."""

    def __init__(self, fleet: Fleet, log: EventLog, consumer_log: EventLog, heal_s: float) -> None:
        self.fleet = fleet
        self.log = log
        self.consumer_log = consumer_log  # the nemesis's own leases (lease_cut)
        self.heal_s = heal_s
        self.stop_event = threading.Event()
        self.done: list[dict[str, Any]] = []

    # -- helpers ---------------------------------------------------------------------------

    def _say(self, action: PAction, t0: float, **fields: Any) -> None:
        t1 = time.time()
        doc = {"kind": action.kind, "t0": t0, "t1": t1, "action": asdict(action),
               "target": self.fleet.names[action.node], **fields}  # fmt: skip
        self.done.append(doc)
        self.log.write("fault", **doc)
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        print(f"nemesis {time.strftime('%H:%M:%S', time.localtime(t0))}+{t1 - t0:5.1f}s "
              f"{action.describe()} {extra}", flush=True)  # fmt: skip

    def _hold(self, seconds: float) -> None:
        self.stop_event.wait(seconds)  # the fault's duration, not synchronisation

    def _healed(self, what: str) -> None:
        self.log.write("heal", what=what)

    # -- the actions -----------------------------------------------------------------------

    def cut_db(self, action: PAction, *, one_way: str = "") -> dict[str, Any]:
        """Cut the target from the database for ``hold_s``, measuring
        cut -> refused and cut -> out of the list; healed at the end."""
        fleet, i = self.fleet, action.node
        cut_at = time.monotonic()
        fleet.cut_db(i, one_way)
        try:
            fields = fleet.measure_cut(i, cut_at, action.hold_s)
            self._hold(max(0.0, cut_at + action.hold_s - time.monotonic()))
        finally:
            fleet.heal_all()
            self._healed(f"n{i} from the database")
        return fields

    def cut_peers(self, action: PAction) -> dict[str, Any]:
        fleet, i = self.fleet, action.node
        fleet.cut_peers(i)
        try:
            self._hold(action.hold_s)
            live = fleet.live_in_db()
        finally:
            fleet.heal_all()
            self._healed(f"n{i} from its peers")
        # Ownership follows the database's list, not who can reach whom.
        return {"live_during": len(live), "all_live": sorted(live) == sorted(fleet.names)}

    def one_way(self, action: PAction) -> dict[str, Any]:
        if action.other < 0:
            return self.cut_db(action, one_way=action.way)
        fleet, i, j = self.fleet, action.node, action.other
        fleet.cut_one_way(i, j, action.way)
        try:
            self._hold(action.hold_s)
        finally:
            fleet.heal_all()
            self._healed(f"n{i} {action.way} n{j}")
        return {}

    def lease_cut(self, action: PAction) -> dict[str, Any]:
        """Leases claimed on the target, held across its cut from the
        database (and its lapse), completed there after it rejoined."""
        fleet, i = self.fleet, action.node
        grants: list[Any] = []
        deadline = time.monotonic() + LEASE_CUT_TRY_S
        while len(grants) < LEASE_CUT_LEASES and time.monotonic() < deadline:
            grants += fleet.claim(i, LEASE_CUT_LEASES - len(grants), LEASE_CUT_LEASE_S, "nemesis")
            self._hold(0.02)  # the claims' pace: the consumers take most due rows first
        for g in grants:
            self.consumer_log.write("claim", key=g.key, lease_id=g.lease_id, node=fleet.names[i],
                                    by="nemesis")  # fmt: skip
        fields = self.cut_db(action)
        fleet.wait_all_back(self.heal_s)
        answers = []
        for g in grants:
            payload = g.payload if isinstance(g.payload, dict) else {}
            result = {"id": payload.get("id"), "nonce": f"nem{g.lease_id % 10**9}", "by": "nemesis"}
            self.consumer_log.write("run", key=g.key, lease_id=g.lease_id, node=fleet.names[i],
                                    **result)  # fmt: skip
            status, rid, code = fleet.complete(i, g.lease_id, g.key, result)
            if status == 200:
                self.consumer_log.write("complete", key=g.key, lease_id=g.lease_id,
                                        nonce=result["nonce"], rid=rid,
                                        node=fleet.names[i])  # fmt: skip
            else:
                self.consumer_log.write("complete_refused", key=g.key, lease_id=g.lease_id,
                                        nonce=result["nonce"], status=status, code=code,
                                        node=fleet.names[i])  # fmt: skip
            answers.append(status if status != 200 else "ok")
        return {**fields, "leases": [g.key for g in grants], "completions": answers}

    def kill(self, action: PAction) -> dict[str, Any]:
        fleet, i = self.fleet, action.node
        fleet.kill(i)
        self._hold(action.hold_s)
        fleet.start(i)
        return {}

    def kill_in_change(self, action: PAction) -> dict[str, Any]:
        """Another node's lapse (cut from the database) or join (a clean
        stop, then a start), and the target killed -9 the moment the
        database's live list shows it."""
        fleet, i, j = self.fleet, action.node, action.other
        other = fleet.names[j]
        fields: dict[str, Any] = {"other": other, "change": action.change}
        t0 = time.monotonic()
        if action.change == "lapse":
            fleet.cut_db(j, "")
            try:
                fleet.wait_live(other, False, 30)
                fields["change_seen_s"] = round(time.monotonic() - t0, 2)
                fleet.kill(i)
            finally:
                fleet.heal_all()
                self._healed(f"n{j} from the database")
        else:
            fleet.stop(j)
            fleet.wait_live(other, False, 30)
            fleet.start(j, wait_ready=False)
            fleet.wait_live(other, True, 60)
            fields["change_seen_s"] = round(time.monotonic() - t0, 2)
            fleet.kill(i)
        self._hold(action.hold_s)
        fleet.start(i)
        return fields

    def skew(self, action: PAction) -> dict[str, Any]:
        fleet, i = self.fleet, action.node
        fleet.stop(i)
        fleet.start(i, skew_s=action.skew_s)
        reported = fleet.wait_skew_reported(i, action.skew_s, 30)
        return {"skew_s": action.skew_s, "reported_skew_s": reported}

    def act(self, action: PAction) -> None:
        t0 = time.time()
        fn = {
            "cut_db": self.cut_db, "blip_db": self.cut_db, "cut_peers": self.cut_peers,
            "one_way": self.one_way, "lease_cut": self.lease_cut, "kill": self.kill,
            "kill_in_change": self.kill_in_change, "skew": self.skew,
        }[action.kind]  # fmt: skip
        try:
            fields = fn(action)
        except Exception as exc:  # noqa: BLE001 - the campaign reports it as a problem
            fields = {"error": repr(exc)[:300]}
        self._say(action, t0, **fields)

    def run(self, actions: list[PAction]) -> None:
        for action in actions:
            if self.stop_event.wait(action.pause_s):  # the schedule's pause
                return
            self.act(action)
            try:
                self.fleet.wait_all_back(self.heal_s)
            except AssertionError as exc:
                self.log.write("not_back", after=action.kind, error=str(exc)[:300])
                print(f"nemesis: not back after {action.describe()}: {exc}", flush=True)

    def heal(self) -> None:
        """Every cut healed, every node running (started again if needed)."""
        self.fleet.heal_all()
        for i in range(len(self.fleet.names)):
            if not self.fleet.running(i):
                self.fleet.start(i)
        self.fleet.wait_all_back(self.heal_s)
