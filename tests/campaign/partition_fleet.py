"""The partition campaign's fleet and clients: N nodes, each in a network
namespace of its own over one PostgreSQL database (tests/netns.py), and
the campaign's producer, outside consumer and receiver speaking to the
whole fleet (docs/reliability.md, "Partitions").

- ``Fleet``: starts, stops, kills and restarts nodes (a restart may skew the
  node's wall clock: a ``sitecustomize`` on its PYTHONPATH offsets
  ``time.time`` and ``time.time_ns`` by ``QN_SKEW_S``), cuts and heals, reads
  the database's live list over loopback (never cut), measures a cut
  (cut -> a claim refused ``not_granting``, cut -> out of the live list).
- ``FleetEndpoint``: the workload's endpoint over every node, one node after
  another, each call (a write, a poll, an ack may go through any node).
- ``FleetOutside``: claims on one node after another and completes each
  lease on the node that granted it.
- ``FleetReceiver``: polls ``/results?scope=cluster``, acks through any node.
- ``ClusterPoller``: ``GET /queue-state?scope=cluster`` on one node after
  another, every answer judged (``partition_checker.judge_cluster_poll``)
  against the table's row counts and the live list read around it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import psycopg

from keeper.ask import ask
from keeper.owners import Ownership
from node.client import Client, ClientError, Grant
from node.testing import ROOT, wait_for
from shm.state import read_state
from tests.campaign import checker
from tests.campaign.partition_checker import judge_cluster_poll
from tests.campaign.workload import (
    CALL_DEADLINE_S,
    RETRY_STATUSES,
    EventLog,
    Outside,
    Receiver,
)
from tests.netns import Host, Net, NsNode

HANDLER = "tests.campaign.handler:work"
TIMEOUT_S = 4.0  # membership_timeout_s
HEARTBEAT_S = 0.2
LEASE_S = 4
OFFER_TIMEOUT_S = 3
WORK_S = 0.3  # per item: the handlers hold leases long enough for a cut to catch them
START_TIMEOUT_S = 90.0
POLL_EVERY_S = 0.4  # the cluster poller's pace (two shared cores)
# A keeper's input-law counters (keeper/report.py), logged as they change.
COUNTERS = ("received", "requeued", "routed", "waiting", "withdrawn", "in_flight", "fenced",
            "input_gap")  # fmt: skip

SITECUSTOMIZE = '''\
"""The partition campaign's clock skew: time.time() and time.time_ns() of
this process (and its children) off by $QN_SKEW_S seconds."""
import os as _os
import time as _time

_off = float(_os.environ.get("QN_SKEW_S") or 0)
if _off:
    _time_time, _time_ns = _time.time, _time.time_ns
    _time.time = lambda: _time_time() + _off
    _time.time_ns = lambda: _time_ns() + int(_off * 1e9)
'''


class Fleet:
    """``names`` nodes, each ``NsNode`` in its host's namespace (module
    docstring). ``marks[i]``: (offset in the node's log, its skew) at each
    start, so its log's times can be read back on the host's clock."""

    def __init__(
        self, net: Net, pg_url: str, work: Path, names: list[str], token: str, extra_env: dict
    ) -> None:
        self.net, self.pg_url, self.token = net, pg_url, token
        self.names = names
        self.hosts: list[Host] = [net.add_host() for _ in names]
        self.skews = [0.0 for _ in names]
        self.marks: list[list[tuple[int, float]]] = [[] for _ in names]
        skew_dir = work / "skew"
        skew_dir.mkdir(parents=True, exist_ok=True)
        (skew_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = {
            "QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": str(TIMEOUT_S),
            "QUEUE_NODE_HEARTBEAT_S": str(HEARTBEAT_S),
            "QUEUE_NODE_TOKEN": token,
            "QUEUE_NODE_OFFER_TIMEOUT_S": str(OFFER_TIMEOUT_S),
            "QUEUE_NODE_DRAIN_TIMEOUT_S": "10",
            "QN_CAMPAIGN_RUNS": str(work / "runs.jsonl"),
            "QN_CAMPAIGN_WORK_S": str(WORK_S),
            "PYTHONPATH": f"{skew_dir}:{ROOT}",
            "QN_SKEW_S": "0",
            **extra_env,
        }
        self.nodes = [
            NsNode(host, work / name, name, "--store", net.db_url(pg_url), "--handler", HANDLER,
                   "--inference-procs", "1", "--lease-s", str(LEASE_S), env=env)
            for host, name in zip(self.hosts, names, strict=True)
        ]  # fmt: skip
        self._db: psycopg.Connection | None = None
        self._db_lock = threading.Lock()

    # -- the database, over loopback (never cut) ----------------------------------------------

    def _sql(self, query: str, args: tuple = ()) -> list[tuple]:
        with self._db_lock:
            for attempt in (1, 2):
                try:
                    if self._db is None or self._db.closed:
                        self._db = psycopg.connect(self.pg_url, autocommit=True, connect_timeout=5)
                    return self._db.execute(query, args).fetchall()
                except psycopg.OperationalError:
                    self._db = None
                    if attempt == 2:
                        raise
        raise AssertionError("unreachable")

    def live_in_db(self) -> list[str]:
        rows = self._sql(
            "SELECT name FROM fleet_nodes WHERE left_at IS NULL"
            " AND heartbeat_at > now() - make_interval(secs => %s) ORDER BY name",
            (TIMEOUT_S,),
        )
        return [r[0] for r in rows]

    def numbers(self) -> dict[int, str]:
        return {n: name for name, n in self._sql("SELECT name, number FROM fleet_nodes")}

    def row_counts(self, now: float) -> tuple[int, int]:
        """(rows, rows due at ``now``) in the table."""
        ((rows, due),) = self._sql(
            "SELECT count(*), count(*) FILTER (WHERE due_at <= %s) FROM schedule", (now,)
        )
        return int(rows), int(due)

    def activity(self) -> list[list[Any]]:
        """The database's sessions of this run: pid, state, what it waits
        on, which pids block it, its transaction's age, its query."""
        rows = self._sql(
            "SELECT pid, state, wait_event_type, wait_event, pg_blocking_pids(pid),"
            " extract(epoch FROM now() - xact_start), left(query, 160)"
            " FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        age = lambda x: None if x is None else round(float(x), 2)  # noqa: E731
        return [[r[0], r[1], r[2], r[3], list(r[4]), age(r[5]), r[6]] for r in rows]

    def table(self) -> dict[str, float]:
        return {k: due for k, due in self._sql("SELECT key, due_at FROM schedule")}

    def close_db(self) -> None:
        with self._db_lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    # -- nodes -------------------------------------------------------------------------------

    def running(self, i: int) -> bool:
        proc = self.nodes[i].proc
        return proc is not None and proc.poll() is None

    def start(self, i: int, skew_s: float | None = None, wait_ready: bool = True) -> None:
        node = self.nodes[i]
        if skew_s is not None:
            self.skews[i] = skew_s
        node.env["QN_SKEW_S"] = str(self.skews[i])
        try:
            offset = node.log_path.stat().st_size
        except FileNotFoundError:
            offset = 0
        self.marks[i].append((offset, self.skews[i]))
        node.start(wait_ready=wait_ready, timeout_s=START_TIMEOUT_S)

    def kill(self, i: int) -> None:
        self.nodes[i].kill()

    def stop(self, i: int) -> int:
        return self.nodes[i].stop(timeout_s=60)

    def wait_live(self, name: str, live: bool, timeout_s: float) -> None:
        wait_for(lambda: (name in self.live_in_db()) == live, timeout_s,
                 f"{name} {'in' if live else 'out of'} the live list")  # fmt: skip

    def ready(self, i: int) -> bool:
        if not self.running(i):
            return False
        try:
            return self.nodes[i].request("GET", "/readyz", headers=self.auth, timeout_s=3)[0] == 200
        except (OSError, KeyError):
            return False

    def wait_all_back(self, timeout_s: float) -> None:
        """Every node running, ready and in the database's live list."""

        def back() -> bool:
            for i in range(len(self.names)):
                self.nodes[i].check_alive()
                if not self.ready(i):
                    return False
            return self.live_in_db() == sorted(self.names)

        wait_for(back, timeout_s, "every node running, ready and live")

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client(self, i: int, timeout_s: float = 10.0) -> Client:
        doc = json.loads((self.nodes[i].data_dir / "node.json").read_text())
        return Client(f"http://{doc['http']}", self.token, timeout_s=timeout_s)

    # -- cuts --------------------------------------------------------------------------------

    def cut_db(self, i: int, one_way: str = "") -> None:
        """The node from the database: both ways, or ``to`` (its packets
        dropped) or ``from`` (the database's dropped)."""
        db, host = self.net.db, self.hosts[i]
        assert db is not None
        if one_way == "to":
            self.net.cut_one_way(host, db)
        elif one_way == "from":
            self.net.cut_one_way(db, host)
        else:
            self.net.cut(host, db)

    def cut_peers(self, i: int) -> None:
        for j, host in enumerate(self.hosts):
            if j != i:
                self.net.cut(self.hosts[i], host)

    def cut_one_way(self, i: int, j: int, way: str) -> None:
        a, b = self.hosts[i], self.hosts[j]
        self.net.cut_one_way(*((a, b) if way == "to" else (b, a)))

    def heal_all(self) -> None:
        hosts = list(self.net.hosts)
        for x, a in enumerate(hosts):
            for b in hosts[x + 1 :]:
                self.net.heal(a, b)

    def measure_cut(self, i: int, cut_at: float, hold_s: float) -> dict[str, Any]:
        """While node ``i`` is cut from the database: probe claims on it
        (a grant is released at once) until one is refused
        ``not_granting``, and the live list until it is out. Both times
        from the cut; whether the database still listed it when it was
        refused; grants after it was out (must be none)."""
        name = self.names[i]
        end = cut_at + hold_s
        refused_s = out_s = None
        live_at_refusal = None
        granted = granted_after_out = 0
        errors: list[str] = []
        try:
            client = self.client(i, timeout_s=10)
        except (OSError, ValueError, KeyError) as exc:
            return {"error": f"no client: {exc}"}
        try:
            while time.monotonic() < end and (refused_s is None or out_s is None):
                if refused_s is None or out_s is not None:
                    try:
                        grants = client.claim(1, lease_s=LEASE_S, consumer="probe")
                        granted += len(grants)
                        if grants and out_s is not None:
                            granted_after_out += len(grants)
                        for g in grants:
                            try:
                                client.release(g.lease_id, g.key)
                            except ClientError:
                                pass
                    except ClientError as exc:
                        if exc.code == "not_granting" and refused_s is None:
                            refused_s = time.monotonic() - cut_at
                            live_at_refusal = name in self.live_in_db()
                        elif exc.code != "not_granting":
                            errors.append(f"{exc.status} {exc.code}")
                if out_s is None and name not in self.live_in_db():
                    out_s = time.monotonic() - cut_at
                self._pace(0.05)
        finally:
            client.close()
        return {
            "refused_s": None if refused_s is None else round(refused_s, 2),
            "out_s": None if out_s is None else round(out_s, 2),
            "live_at_refusal": live_at_refusal,
            "probe_grants": granted,
            "granted_after_out": granted_after_out,
            "probe_errors": sorted(set(errors))[:5],
        }

    @staticmethod
    def _pace(seconds: float) -> None:
        threading.Event().wait(seconds)  # a probe's pace, not synchronisation

    # -- leases for the nemesis --------------------------------------------------------------

    def claim(self, i: int, n: int, lease_s: float, consumer: str) -> list[Grant]:
        try:
            with self.client(i) as c:
                return c.claim(n, lease_s=lease_s, consumer=consumer)
        except (ClientError, OSError, ValueError, KeyError):
            return []

    def complete(self, i: int, lease_id: int, key: str, result: Any) -> tuple[int, Any, str]:
        """(status, result id, code): retried on 0/503 to CALL_DEADLINE_S."""
        deadline = time.monotonic() + CALL_DEADLINE_S
        while True:
            try:
                with self.client(i) as c:
                    return 200, c.complete(lease_id, key, result), ""
            except ClientError as exc:
                if exc.status not in RETRY_STATUSES or time.monotonic() > deadline:
                    return exc.status, None, exc.code
            except (OSError, ValueError, KeyError) as exc:
                if time.monotonic() > deadline:
                    return 0, None, repr(exc)
            self._pace(0.5)

    def wait_skew_reported(self, i: int, skew_s: float, timeout_s: float) -> Any:
        """The skew node ``i``'s membership reports (the database's clock
        minus its own: about ``-skew_s``), once it does; the last seen at
        the deadline."""
        seen: list[Any] = [None]

        def reported() -> bool:
            try:
                member = self.state(i)["trust"]["membership"]
            except Exception:  # noqa: BLE001 - not up yet
                return False
            seen[0] = {"skew_s": member.get("skew_s"), "flagged": member.get("skew_flagged")}
            got = member.get("skew_s")
            return got is not None and abs(got + skew_s) < 0.5

        try:
            wait_for(reported, timeout_s, "the skew reported")
        except AssertionError:
            pass
        return seen[0]

    # -- at the end --------------------------------------------------------------------------

    def state(self, i: int) -> dict[str, Any]:
        """Node ``i``'s queue state from its segment, judged on its own
        clock (a skewed node's heartbeats are stamped with its skew: on the
        host's clock they would look stale)."""
        return read_state(self.names[i], now=time.time() + self.skews[i])

    def held(self, i: int) -> set[str]:
        reply = ask(self.names[i], {"op": "dump"}, timeout_s=10)
        assert reply is not None and reply["ok"], reply
        return {row[0] for row in msgpack.unpackb(Path(reply["path"]).read_bytes())["rows"]}

    def exact(self, keys: list[str], why: list[str]) -> bool:
        """Every node vouches, exact, with every node as its live list,
        holds exactly its rendezvous share of ``keys`` and counts its
        share's due rows (``why``: the first thing that is not so)."""
        names = sorted(self.names)
        why.clear()
        for name in names:
            try:
                state = self.state(self.names.index(name))
            except Exception as exc:  # noqa: BLE001 - not up, or rewriting
                why.append(f"{name}: no state ({exc})")
                return False
            trust = state.get("trust") or {}
            if not (trust.get("vouched") and trust.get("exact")):
                why.append(f"{name}: not vouched/exact: {trust.get('reason')}")
                return False
            if (trust.get("membership") or {}).get("live") != names:
                why.append(f"{name}: live list {(trust.get('membership') or {}).get('live')}")
                return False
            mine = set(Ownership(names, name).mine(keys))
            held = self.held(self.names.index(name))
            if held != mine:
                extra, missing = sorted(held - mine)[:5], sorted(mine - held)[:5]
                why.append(f"{name}: holds {len(held)} keys, owns {len(mine)}: "
                           f"extra {extra} missing {missing}")  # fmt: skip
                return False
        return True

    def log_events(self, i: int) -> list[tuple[float, str, str, str]]:
        """The node's ``action=`` lines, their times on the host's clock
        (a skewed run's lines less its skew)."""
        path = self.nodes[i].log_path
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        marks = self.marks[i] or [(0, 0.0)]
        out = []
        for k, (offset, skew) in enumerate(marks):
            end = marks[k + 1][0] if k + 1 < len(marks) else len(data)
            text = data[offset if k else 0 : end].decode(errors="replace")
            out += [(t - skew, role, action, rest)
                    for t, role, action, rest in checker.parse_node_log(text)]  # fmt: skip
        return out


class NodeEndpoint:
    """One node's client (its address from node.json), with the token."""

    def __init__(self, data_dir: Path, token: str, timeout_s: float = 10.0) -> None:
        self.data_dir, self.token, self.timeout_s = data_dir, token, timeout_s
        self._client: Client | None = None

    def client(self) -> Client:
        if self._client is None:
            try:
                doc = json.loads((self.data_dir / "node.json").read_text())
                url = f"http://{doc['http']}"
            except (OSError, ValueError, KeyError):
                raise ClientError(0, "unreachable", "node.json not there (restarting)") from None
            self._client = Client(url, self.token, timeout_s=self.timeout_s)
        return self._client

    def forget(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None


def call(
    pick: Callable[[], NodeEndpoint],
    fn: Callable[[Client], Any],
    stop: threading.Event,
    deadline_s: float = CALL_DEADLINE_S,
) -> Any:
    """``fn`` on the endpoint ``pick()`` gives, until it answers; a 0 or a
    503 is retried with backoff (``pick`` again: another node, for a
    fleet-wide call) to the deadline, then raised."""
    deadline = time.monotonic() + deadline_s
    delay = 0.05
    while True:
        endpoint = pick()
        try:
            return fn(endpoint.client())
        except ClientError as exc:
            if exc.status not in RETRY_STATUSES or time.monotonic() >= deadline:
                raise
            if exc.status == 0:
                endpoint.forget()
        if stop.wait(delay):  # backoff between retries, cut short by a stop
            raise ClientError(0, "stopped", "the campaign stopped")
        delay = min(delay * 2, 1.0)


class FleetEndpoint:
    """The workload's ``Endpoint`` over every node: each ``client()`` is the
    next node's (round robin), so a write, a poll or an ack goes through
    any node and a node cut off or down costs one try."""

    def __init__(self, dirs: list[Path], token: str) -> None:
        self.endpoints = [NodeEndpoint(d, token) for d in dirs]
        self._next = 0
        self._current = self.endpoints[0]

    def pick(self) -> NodeEndpoint:
        self._current = self.endpoints[self._next % len(self.endpoints)]
        self._next += 1
        return self._current

    def client(self) -> Client:
        return self.pick().client()

    def forget(self) -> None:
        self._current.forget()

    def call(self, fn: Callable[[Client], Any], stop: threading.Event,
             deadline_s: float = CALL_DEADLINE_S) -> Any:  # fmt: skip
        return call(self.pick, fn, stop, deadline_s)

    def close(self) -> None:
        for e in self.endpoints:
            e.forget()


class FleetOutside(Outside):
    """The outside GPU consumer over a fleet: each round claims on the next
    node and completes each lease on the node that granted it (its lease
    table holds the lease). Logs the node with every claim and completion."""

    def __init__(self, dirs: list[Path], names: list[str], token: str, log: EventLog,
                 rng: Any, lease_s: float) -> None:  # fmt: skip
        super().__init__(dirs[0], log, rng, lease_s)
        self.names = names
        self.per_node = [NodeEndpoint(d, token) for d in dirs]
        self.endpoint = FleetEndpoint(dirs, token)  # type: ignore[assignment]
        self._round = 0

    def body(self) -> None:
        while not self.stop_event.is_set():
            k = self._round % len(self.per_node)
            self._round += 1
            endpoint = self.per_node[k]
            try:
                grants = call(lambda e=endpoint: e,  # type: ignore[misc]
                              lambda c: c.claim(8, lease_s=self.lease_s, consumer="outside"),
                              self.stop_event, deadline_s=5)  # fmt: skip
            except ClientError as exc:
                if exc.code == "stopped":
                    return
                self.log.write("claim_error", node=self.names[k], status=exc.status,
                               code=exc.code)  # fmt: skip
                continue
            if not grants:
                self.stop_event.wait(0.2)  # idle pacing: nothing due
                continue
            for g in grants:
                self.log.write("claim", key=g.key, lease_id=g.lease_id, node=self.names[k])
            for g in grants:
                self._run_on(g, endpoint, self.names[k])

    def _run_on(self, g: Grant, endpoint: NodeEndpoint, name: str) -> None:
        if self.rng.random() < self.slow_p:
            self.stop_event.wait(self.lease_s * self.rng.uniform(1.5, 4.0))  # a slow holder
        payload = g.payload if isinstance(g.payload, dict) else {}
        result = {"id": payload.get("id"), "nonce": uuid.uuid4().hex[:12], "by": "outside"}
        self.log.write("run", key=g.key, lease_id=g.lease_id, node=name, **result)
        try:
            rid = call(lambda: endpoint, lambda c: c.complete(g.lease_id, g.key, result),
                       self.stop_event)  # fmt: skip
            self.log.write("complete", key=g.key, lease_id=g.lease_id, nonce=result["nonce"],
                           rid=rid, node=name)  # fmt: skip
        except ClientError as exc:
            self.log.write("complete_refused", key=g.key, lease_id=g.lease_id,
                           nonce=result["nonce"], status=exc.status, code=exc.code,
                           node=name)  # fmt: skip

    def run(self) -> None:
        try:
            super().run()
        finally:
            for e in self.per_node:
                e.forget()


class FleetReceiver(Receiver):
    """The receiver over a fleet: polls ``/results?scope=cluster`` through
    one node after another; acks through any node (routed by the ids'
    node numbers)."""

    def __init__(self, dirs: list[Path], token: str, log: EventLog, rng: Any) -> None:
        super().__init__(dirs[0], log, rng)
        self.endpoint = FleetEndpoint(dirs, token)  # type: ignore[assignment]

    def body(self) -> None:
        sent = [0.0]

        def poll(c: Any) -> Any:
            sent[0] = time.time()  # this attempt's start: the offer came after it
            return c.poll(None, max=200, wait_s=1, scope="cluster")

        while not self.stop_event.is_set():
            try:
                results = self.endpoint.call(poll, self.stop_event)
            except ClientError as exc:
                if exc.code == "stopped":
                    return
                self.log.write("poll_error", status=exc.status, code=exc.code)
                continue
            by_job: dict[str, list[int]] = defaultdict(list)
            for r in results:
                # ``sent``: the node offered it after this, and its offer
                # timeout runs from then, not from the answer's arrival (a
                # fan-out through a slow peer can take seconds).
                self.log.write("offer", rid=r["id"], key=r["key"], job=r["job"],
                               result=r["result"], sent=sent[0])  # fmt: skip
                first = r["id"] not in self.seen
                with self._lock:
                    self.seen[r["id"]] = r["key"]
                if first and self.rng.random() < self.skip_p:
                    self.log.write("skip", rid=r["id"])
                    continue
                by_job[r["job"]].append(r["id"])
            for job, ids in by_job.items():
                self._ack(job, ids)


class ClusterPoller(threading.Thread):
    """``GET /queue-state?scope=cluster`` on one node after another, every
    ``POLL_EVERY_S``, with the live list and the table's row count read
    just before and just after; each answer judged at once. ``records``:
    every answer's summary; ``bad``: the problems."""

    def __init__(self, fleet: Fleet, log: EventLog) -> None:
        super().__init__(name="cluster-poller", daemon=True)
        self.fleet, self.log = fleet, log
        self.stop_event = threading.Event()
        self.counts = {"200": 0, "503": 0, "no answer": 0}
        self.bad: list[str] = []
        self.history: list[tuple[float, int]] = []  # (time, rows in the table)
        self.changes: list[tuple[float, list[str]]] = []  # the live list, when it changed
        self.error: BaseException | None = None
        self._counters: dict[str, dict[str, Any]] = {}

    def sample(self) -> tuple[list[str], int]:
        live = self.fleet.live_in_db()
        t = time.time()
        rows, _ = self.fleet.row_counts(t)
        self.history.append((t, rows))
        if not self.changes or self.changes[-1][1] != live:
            lost = bool(self.changes) and len(live) < len(self.changes[-1][1])
            self.changes.append((t, live))
            self.log.write("live", nodes=live)
            if lost:  # who waits on what in the database when a node drops out
                self.log.write("activity", rows=self.fleet.activity())
        return live, rows

    def counters(self) -> None:
        """Each running node's input counters (its segment), logged when
        they change: the timeline a gap is read from."""
        for i, name in enumerate(self.fleet.names):
            try:
                c = self.fleet.state(i).get("counters") or {}
            except Exception:  # noqa: BLE001 - not up, or rewriting
                continue
            doc = {k: c.get(k) for k in COUNTERS}
            if doc != self._counters.get(name):
                self._counters[name] = doc
                self.log.write("counters", node=name, **doc)

    def run(self) -> None:
        k = 0
        try:
            while not self.stop_event.wait(POLL_EVERY_S):  # the poll's pace
                k += 1
                self.counters()
                node = self.fleet.nodes[k % len(self.fleet.nodes)]
                live_before, rows_before = self.sample()
                try:
                    status, doc = node.request("GET", "/queue-state?scope=cluster",
                                               headers=self.fleet.auth, timeout_s=10)  # fmt: skip
                except (OSError, KeyError):
                    self.counts["no answer"] += 1
                    continue
                live_after, rows_after = self.sample()
                problem = judge_cluster_poll(
                    status, doc, live_before, live_after, rows_before, rows_after, self.history
                )
                if status in (200, 503):
                    self.counts[str(status)] += 1
                    trust = (doc.get("trust") or {}) if isinstance(doc, dict) else {}
                    per = trust.get("nodes") or {}
                    self.log.write("poll", node=node.name, status=status, live=live_after,
                                   gaps={n: p.get("input_gap") for n, p in per.items()},
                                   rows=(doc.get("now") or {}).get("rows"))  # fmt: skip
                if problem:
                    self.bad.append(f"{node.name}: {problem}")
                    self.log.write("bad_cluster_state", node=node.name, problem=problem,
                                   status=status, doc=doc)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - reported by the campaign
            self.error = exc

    def finish(self) -> None:
        self.stop_event.set()
        self.join(30)
