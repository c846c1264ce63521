"""Acceptance: faults on the work path (issue 3), with real processes.

Every test runs a real ``python -m node run`` (keeper, ledger, HTTP workers as
subprocesses) and an external consumer over HTTP (``node.client.Client``):
claim, complete, poll, ack. Faults are real: ``kill -9`` of one child (the
ledger, an HTTP worker) or of the whole node (supervisor and every child,
``NodeProcess.kill``), and a clean SIGTERM restart; the data directory and,
after a crash, the shared-memory segments are kept for the next start, as they
would be on a host.

What every test checks at the end (DESIGN invariants 1 to 5): every key is
finished exactly once, every durable result is offered until acknowledged, no
live lease is granted again, and ``/accounting`` balances to the item.

(The kill -9 of an inference process mid-batch is in tests/acceptance/test_inference.py.)

Waits poll a condition up to a deadline (``wait_for``); nothing sleeps to
synchronise. The time-based windows are negative checks only: "no grant of a
held key across three keeper publishes" (counted by the state buffer's publish
counter) and "the request in flight at SIGTERM is answered before the drain
deadline".

A bug these tests found, now fixed and kept as a regression test: a SIGTERM
that lands between a request's headers and its body left the request
unanswered and held the drain to its deadline.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from node.client import Client, ClientError
from node.testing import NodeProcess, finish, wait_for

pytestmark = pytest.mark.timeout(60)

CADENCE_30D = 30 * 86400
# A caller retries on these: the node cannot be reached (status 0: a worker
# died with the connection, or is restarting), or it says 503 (the ledger is
# restarting: ledger_unavailable, lease_busy, not_ready).
RETRY_STATUSES = (0, 503)


@pytest.fixture
def nodes(tmp_path, node_name):
    """``nodes(*args, env=...)`` starts a node on this test's data directory;
    called again it starts the next run on the same directory (and, after a
    crash, on the segments the dead node left)."""
    started: list[NodeProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> NodeProcess:
        node = NodeProcess(tmp_path / "data", node_name, *args, env=env)
        started.append(node)
        node.start()
        return node

    yield start
    finish(started, node_name)


# -- helpers ---------------------------------------------------------------------------


def _keys(n: int, prefix: str) -> list[str]:
    return [f"{prefix}/{i:05d}" for i in range(n)]


def _seed(client: Client, keys: list[str], jobs: tuple[str, ...] = ("j",)) -> None:
    """Rows with a 30-day cadence, all due (an hour late)."""
    due = time.time() - 3600
    rows = [
        {"key": k, "route": "r", "cadence_s": CADENCE_30D, "due_at": due,
         "payload": {"k": k}, "job": jobs[i % len(jobs)]}
        for i, k in enumerate(keys)
    ]  # fmt: skip
    for at in range(0, len(rows), 5000):
        batch = rows[at : at + 5000]
        assert client.upsert(batch) == len(batch)


def _call(fn: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    """``fn()`` until it answers, retrying while the node is unreachable or
    answers 503 (the contract says: retry). Any other refusal raises."""
    box: list[Any] = []

    def once() -> bool:
        try:
            box.append(fn())
        except ClientError as exc:
            if exc.status in RETRY_STATUSES:
                return False
            raise
        return True

    wait_for(once, timeout_s, what)
    return box[0]


def _claim(
    client: Client,
    n: int,
    lease_s: float,
    consumer: str,
    avoid: frozenset[str] | set[str] = frozenset(),
    timeout_s: float = 20.0,
) -> dict[str, Any]:
    """Claim until ``n`` leases came back (the keeper publishes within about
    a second); key -> Grant. No key twice, none of ``avoid``."""
    got: dict[str, Any] = {}

    def more() -> bool:
        grants = _call(
            lambda: client.claim(min(100, n - len(got)), lease_s=lease_s, consumer=consumer),
            "a claim",
        )
        for g in grants:
            assert g.key not in avoid, f"{g.key} granted while its lease lives"
            assert g.key not in got, f"{g.key} granted twice"
            got[g.key] = g
        return len(got) >= n

    wait_for(more, timeout_s, f"{n} leases for {consumer}")
    assert len(got) == n
    return got


def _generation(name: str) -> int:
    """Keeper publishes since the node started (the state buffer's counter)."""
    from shm.state import StateBuffer

    with StateBuffer.attach(name, read_only=True) as buf:
        return buf.read()["generation"]


def _nothing_granted_across_publishes(client: Client, name: str, publishes: int = 3) -> None:
    """Claims find nothing while at least ``publishes`` keeper publishes (and
    at least one periodic one, > 1 s) go by: the keys that are leased, or
    finished and written back, are not in the ready set and are not granted."""
    start_gen = _generation(name)
    start = time.monotonic()

    def quiet_long_enough() -> bool:
        grants = _call(lambda: client.claim(100, lease_s=60, consumer="prober"), "a probe claim")
        assert grants == [], f"granted again: {[g.key for g in grants]}"
        return _generation(name) >= start_gen + publishes and time.monotonic() - start > 1.2

    wait_for(quiet_long_enough, 20, f"{publishes} publishes without a grant")


def _accounting(client: Client) -> dict[str, Any]:
    return _call(client.accounting, "/accounting")


def _settled(client: Client, **want: int) -> dict[str, Any]:
    """/accounting once it shows ``want`` and balances (the ledger flushes
    and sweeps every 100 ms: a moment after the last event it is quiescent)."""
    last: list[dict[str, Any]] = []

    def check() -> bool:
        acct = _accounting(client)
        last[:] = [acct]
        return acct["balanced"] and all(acct[k] == v for k, v in want.items())

    try:
        wait_for(check, 20, f"/accounting balanced with {want}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: last answer {last}") from None
    return last[0]


def _drain(
    client: Client, want_keys: set[str], timeout_s: float = 30.0, per_poll: int = 1000
) -> dict[str, dict]:
    """Poll every job and ack what comes, until every key in ``want_keys`` has
    a result; key -> result. Asserts that no key has two results and no id
    is offered again after its ack was answered."""
    by_key: dict[str, dict] = {}
    acked: set[int] = set()

    def more() -> bool:
        results = _call(lambda: client.poll(None, max=per_poll), "a poll")
        by_job: dict[str, list[int]] = defaultdict(list)
        for r in results:
            assert r["id"] not in acked, f"id {r['id']} offered again after its ack"
            seen = by_key.get(r["key"])
            assert seen is None or seen["id"] == r["id"], f"two results for {r['key']}"
            by_key[r["key"]] = r
            by_job[r["job"]].append(r["id"])
        for job, ids in by_job.items():
            _call(lambda job=job, ids=ids: client.ack(job, ids), "an ack")
            acked.update(ids)
        return want_keys <= set(by_key)

    wait_for(more, timeout_s, f"results of {len(want_keys)} keys")
    assert set(by_key) == want_keys, sorted(set(by_key) - want_keys)[:10]
    assert client.poll(None, max=1000) == []
    return by_key


def _log(node: NodeProcess) -> str:
    """The whole log of the node's runs on this data directory."""
    return node.log_path.read_text(errors="replace")


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def _all_pids(node: NodeProcess) -> list[int]:
    pids = node.pids()
    return [node.proc.pid, pids["keeper"], pids["ledger"], *pids["workers"], *pids["inference"]]


# -- 1. nothing fails: exactly once ---------------------------------------------------


def test_one_shot_workload_is_finished_and_acknowledged_exactly_once(nodes):
    """2,000 rows, 30-day cadence, all due; an external consumer claims in
    batches, completes each lease, polls /results and acks: every key is
    granted, completed, offered and acked exactly once, and the ledger
    balances to the item."""
    node = nodes()
    client = Client(node.base_url)
    keys = _keys(2000, "once")
    _seed(client, keys, jobs=("pages", "feeds"))

    granted: Counter[str] = Counter()
    key_of: dict[int, str] = {}  # result id -> key, from the completions
    offered: Counter[int] = Counter()
    acked: set[int] = set()

    def step() -> bool:
        for g in client.claim(100, lease_s=120, consumer="one-shot"):
            granted[g.key] += 1
            assert granted[g.key] == 1, f"{g.key} granted twice"
            rid = client.complete(g.lease_id, g.key, {"key": g.key, "job": g.job})
            assert isinstance(rid, int) and rid not in key_of
            key_of[rid] = g.key
        by_job: dict[str, list[int]] = defaultdict(list)
        for r in client.poll(None, max=1000):
            assert r["id"] not in acked, f"id {r['id']} offered after its ack"
            offered[r["id"]] += 1
            assert key_of.get(r["id"]) == r["key"], r
            assert r["result"] == {"key": r["key"], "job": r["job"]}, r
            by_job[r["job"]].append(r["id"])
        for job, ids in by_job.items():
            assert client.ack(job, ids) == len(ids)  # each id acked once, by this request
            acked.update(ids)
        return len(acked) == len(keys)

    wait_for(step, 50, "every result acked")
    assert set(granted) == set(keys) and set(granted.values()) == {1}
    assert sorted(key_of.values()) == keys  # completed exactly once each
    assert set(offered) == set(key_of) and set(offered.values()) == {1}
    assert acked == set(key_of)
    assert client.claim(100, consumer="one-shot") == []  # written back 30 days on
    assert client.poll(None, max=1000) == []
    acct = _settled(client, routed=2000, finished=2000, acknowledged=2000, in_flight=0)
    assert (acct["awaiting_ack"], acct["expired"], acct["released"], acct["refused"]) == (
        0, 0, 0, 0
    ), acct  # fmt: skip
    client.close()
    assert node.stop() == 0


# -- 2. a clean restart while an external consumer holds leases -------------------------


def test_clean_restart_keeps_external_leases_and_accepts_their_results(nodes):
    node = nodes()
    client = Client(node.base_url)
    keys = _keys(200, "clean")
    _seed(client, keys)
    held = _claim(client, 50, lease_s=300, consumer="gpu-outside")
    before = {(x["key"], x["lease_id"], x["expires_at"]) for x in client.leases()}
    assert before == {(g.key, g.lease_id, g.expires_at) for g in held.values()}
    client.close()

    assert node.stop() == 0  # SIGTERM: leases saved, segments removed
    node = nodes()  # the same data directory
    client = Client(node.base_url)
    after = client.leases()
    # The same leases, same ids, same holder, same expiry: nothing was renewed or lost.
    assert {(x["key"], x["lease_id"], x["expires_at"]) for x in after} == before
    assert {x["consumer"] for x in after} == {"gpu-outside"}
    _settled(client, routed=50, in_flight=50, finished=0)

    # The other 150 are granted; none of the 50 while their leases live.
    others = _claim(client, 150, lease_s=300, consumer="gpu-new", avoid=set(held))
    _nothing_granted_across_publishes(client, node.name)

    # The results of leases granted by the previous run are accepted.
    for g in held.values():
        assert isinstance(client.complete(g.lease_id, g.key, {"old": g.lease_id}), int)
    for g in others.values():
        assert isinstance(client.complete(g.lease_id, g.key, {"new": g.lease_id}), int)
    results = _drain(client, set(keys))
    for g in held.values():
        assert results[g.key]["result"] == {"old": g.lease_id}
    _settled(client, routed=200, finished=200, acknowledged=200, in_flight=0, awaiting_ack=0)
    client.close()
    assert node.stop() == 0


# -- 3. kill -9 of the whole node while leases are held -------------------------------


def test_kill_9_of_the_whole_node_while_leases_are_held(nodes):
    """At the crash: 40 leases live, 60 results durable (10 acked, 20
    offered and not acked, 30 never offered), 100 rows never claimed. After
    the restart on the same data directory and the segments the crash left:
    the 40 are not granted again and their results are accepted; every
    durable unacked result is offered, again after the offer timeout, until
    acked; acked ones never come back; the ledger balances."""
    env = {"QUEUE_NODE_OFFER_TIMEOUT_S": "2"}
    node = nodes(env=env)
    client = Client(node.base_url)
    keys = _keys(200, "crash")
    _seed(client, keys)
    grants = sorted(_claim(client, 100, lease_s=300, consumer="gpu-a").values(),
                    key=lambda g: g.key)  # fmt: skip
    done, live = grants[:60], grants[60:]
    rid = {g.key: client.complete(g.lease_id, g.key, {"k": g.key}) for g in done}
    assert all(isinstance(x, int) for x in rid.values())
    offered: list[dict] = []
    wait_for(lambda: offered.extend(client.poll("j", max=30 - len(offered))) or len(offered) >= 30,
             10, "30 offers")  # fmt: skip
    assert client.ack("j", [r["id"] for r in offered[:10]]) == 10
    acked_before = {r["key"] for r in offered[:10]}
    offered_unacked = [r["id"] for r in offered[10:]]
    pids = _all_pids(node)
    client.close()

    node.kill()  # supervisor and every child, kill -9
    wait_for(lambda: _gone(pids), 10, "every process of the node to die")
    node = nodes(env=env)
    assert "leases_reattached" in _log(node)
    client = Client(node.base_url)
    assert {(x["key"], x["lease_id"], x["expires_at"]) for x in client.leases()} == {
        (g.key, g.lease_id, g.expires_at) for g in live
    }
    # Ids the dead ledger offered can be acked without polling them again.
    assert client.ack("j", offered_unacked) == len(offered_unacked)
    acked_before |= {r["key"] for r in offered[10:]}

    # The 100 never claimed are granted; nothing leased or finished is.
    rest = _claim(client, 100, lease_s=300, consumer="gpu-b", avoid={g.key for g in grants})
    _nothing_granted_across_publishes(client, node.name)
    for g in live:  # leases granted before the crash: their results are accepted
        rid[g.key] = client.complete(g.lease_id, g.key, {"k": g.key})
    for g in rest.values():
        rid[g.key] = client.complete(g.lease_id, g.key, {"k": g.key})
    assert all(isinstance(x, int) for x in rid.values())

    # Every durable result not acked is offered: once now, and once more after
    # the offer timeout because nobody acked it; acked ones never.
    want = set(keys) - acked_before
    first: dict[str, int] = {}

    def offered_once() -> bool:
        for r in client.poll(None, max=1000):
            assert r["key"] in want, f"{r['key']} offered after its ack"
            assert r["id"] == rid[r["key"]] and r["result"] == {"k": r["key"]}, r
            first.setdefault(r["key"], r["id"])
        return set(first) == want

    wait_for(offered_once, 10, "every unacked result offered")
    again: set[str] = set()

    def offered_again_then_acked() -> bool:
        results = client.poll(None, max=1000, wait_s=2)
        for r in results:
            assert r["key"] in want and r["id"] == first[r["key"]], r
            assert r["key"] not in again, f"{r['key']} offered after its ack"
        if results:
            assert client.ack("j", [r["id"] for r in results]) == len(results)
            again.update(r["key"] for r in results)
        return again == want

    wait_for(offered_again_then_acked, 20, "every result offered again, then acked")
    assert client.poll(None, max=1000) == []
    _settled(client, routed=200, finished=200, acknowledged=200, in_flight=0, awaiting_ack=0)
    client.close()
    assert node.stop() == 0


# -- 4. kill -9 of the ledger (or the whole node) mid-append ------------------------


@pytest.mark.parametrize("victim", ["ledger", "node", "sigterm"])
def test_kill_9_mid_append_while_completions_stream_in(nodes, victim):
    """A client thread completes 400 leases one by one; after 80 the ledger
    (or the whole node) is killed, wherever it is: appending, in the fsync,
    writing back, ending a lease, answering; or the node is stopped cleanly
    (SIGTERM) and started again. Every completion answered 200 is durable and
    offered later; those that failed are retried once the ledger is back
    (restarted by the supervisor, or with the node on the same data
    directory) and are accepted exactly once (200, or 200 as a repeat); the
    ledger balances to the item.

    The SIGTERM run has a short drain deadline: when the signal lands between
    a request's headers and its body, the worker does not answer it and waits
    out the deadline (the bug pinned by
    test_sigterm_while_a_request_body_is_on_its_way_answers_it_and_stops_promptly);
    then the supervisor kills what is left, which must lose nothing either."""
    env = {"QUEUE_NODE_DRAIN_TIMEOUT_S": "5"}
    node = nodes(env=env)
    client = Client(node.base_url)
    keys = _keys(400, "ledger")
    _seed(client, keys)
    grants = _claim(client, 400, lease_s=300, consumer="gpu")
    ok: dict[str, int | None] = {}
    failed: dict[str, str] = {}
    errors: list[BaseException] = []

    def completer() -> None:
        c = Client(node.base_url)
        try:
            for g in grants.values():
                try:
                    ok[g.key] = c.complete(g.lease_id, g.key, {"k": g.key})
                except ClientError as exc:
                    if exc.status not in RETRY_STATUSES:
                        raise
                    failed[g.key] = exc.code
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
        finally:
            c.close()

    thread = threading.Thread(target=completer, daemon=True)
    thread.start()
    wait_for(lambda: len(ok) >= 80 or not thread.is_alive(), 20, "80 completions")
    if victim == "ledger":
        ledger = node.pids()["ledger"]
        os.kill(ledger, signal.SIGKILL)
        wait_for(lambda: node.pids()["ledger"] not in (None, ledger), 20, "a new ledger")
    else:
        pids = _all_pids(node)
        if victim == "node":
            node.kill()
        else:  # a clean restart in the middle of the stream
            assert node.stop() == 0
        wait_for(lambda: _gone(pids), 10, "every process of the node to die")
        client.close()
        node = nodes(env=env)  # a new port: the thread's calls fail from now on
        client = Client(node.base_url)
    thread.join(40)
    assert not thread.is_alive() and not errors, errors
    assert len(ok) + len(failed) == 400
    assert failed, "no completion met the dead ledger: the kill came too late"
    assert set(failed.values()) <= {"ledger_unavailable", "unreachable", "lease_busy"}, failed

    retried: dict[str, int | None] = {}
    for key in failed:
        g = grants[key]
        retried[key] = _call(lambda g=g: client.complete(g.lease_id, g.key, {"k": g.key}),
                             f"the retry of {key}")  # fmt: skip
    # One retried twice is a repeat: 200 again, nothing written again.
    some = grants[next(iter(failed))]
    client.complete(some.lease_id, some.key, {"k": some.key})

    results = _drain(client, set(keys))
    for key, rid in ok.items():
        assert results[key]["id"] == rid, (key, rid, results[key])
    for key in keys:
        assert results[key]["result"] == {"k": key}
    _settled(client, routed=400, finished=400, acknowledged=400, in_flight=0, awaiting_ack=0)
    evidence = {"ledger": "child_died", "node": "leases_reattached", "sigterm": "leases_loaded"}
    assert evidence[victim] in _log(node)
    client.close()
    assert node.stop() == 0


# -- 4b. SIGTERM while a request's body is on its way ---------------------------------


def _recv_until(sock: socket.socket, marker: bytes, timeout_s: float) -> bytes:
    """Bytes from ``sock`` until ``marker`` has come, the peer closed, or the
    deadline passed."""
    got = b""
    deadline = time.monotonic() + timeout_s
    while marker not in got:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        got += chunk
    return got


def _listening(pid: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN for c in psutil.Process(pid).net_connections())
    except psutil.NoSuchProcess:
        return False


def test_sigterm_while_a_request_body_is_on_its_way_answers_it_and_stops_promptly(nodes):
    """A completion's headers reach the worker (it answers ``100 Continue``:
    the handler is reading the body); the node is sent SIGTERM; once the
    worker stopped listening, the body arrives. The request in flight must be
    answered, and the node must stop well within its drain deadline."""
    drain_s = 6
    node = nodes(env={"QUEUE_NODE_DRAIN_TIMEOUT_S": str(drain_s)})
    client = Client(node.base_url)
    _seed(client, ["term/0"])
    (g,) = _claim(client, 1, lease_s=300, consumer="gpu").values()
    client.close()
    body = json.dumps({"lease_id": g.lease_id, "key": g.key, "result": {"k": g.key}}).encode()
    host, port = node.info["http"].rsplit(":", 1)
    (worker,) = node.pids()["workers"]
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(
            b"POST /complete HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        assert b" 100 " in _recv_until(sock, b"\r\n\r\n", 5)  # the handler reads the body
        started = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not _listening(worker), 5, "the worker to stop listening")
        sock.sendall(body)
        answer = _recv_until(sock, b"}", drain_s - 2)
    rc = node.proc.wait(timeout=drain_s + 20)
    stopped_s = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert rc == 0
    assert stopped_s < drain_s - 1, f"the stop took {stopped_s:.1f} s (drain deadline {drain_s} s)"
    assert "drain_timeout" not in _log(node)


# -- 5. kill -9 of an HTTP worker mid-claim --------------------------------------------


class _LeaseSampler(threading.Thread):
    """Samples ``GET /leases`` every 20 ms until stopped: asserts that no
    snapshot shows a key twice, and keeps every lease it saw as lease_id ->
    (key, granted_at, expires_at). Unreachable or 503 (the worker is being
    restarted) is skipped."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.seen: dict[int, tuple[str, float, float]] = {}
        self.snapshots = 0
        self.errors: list[BaseException] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        client = Client(self.base_url, timeout_s=5)
        try:
            while not self._stop_event.is_set():
                try:
                    live = client.leases(limit=10_000)
                except ClientError as exc:
                    if exc.status not in RETRY_STATUSES:
                        raise
                    continue
                self.snapshots += 1
                twice = [k for k, m in Counter(x["key"] for x in live).items() if m > 1]
                assert not twice, f"keys leased twice at once: {twice[:5]}"
                for x in live:
                    self.seen[x["lease_id"]] = (x["key"], x["granted_at"], x["expires_at"])
                self._stop_event.wait(0.02)  # pacing, not synchronisation
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            self.errors.append(exc)
        finally:
            client.close()

    def finish(self) -> None:
        self._stop_event.set()
        self.join(10)
        assert not self.is_alive() and not self.errors, self.errors


def _kill_worker_mid_claim(node: NodeProcess, table: Any, n: int, lease_s: float) -> Any:
    """Send a claim of ``n`` from a thread, on a fresh connection (so the
    client never re-sends it), and kill -9 the HTTP worker as soon as the
    lease table counts the claim's first grant. Returns what the claim got
    (the ClientError of a dead connection, when the kill came mid-claim)."""
    box: list[Any] = []

    def claim() -> None:
        c = Client(node.base_url)
        try:
            box.append(c.claim(n, lease_s=lease_s, consumer="doomed"))
        except ClientError as exc:
            box.append(exc)
        finally:
            c.close()

    (worker,) = node.pids()["workers"]
    grants0 = table.counters()["grants"]
    thread = threading.Thread(target=claim, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while table.counters()["grants"] == grants0:  # a tight spin: the claim lasts ~0.1 s
        assert time.monotonic() < deadline and thread.is_alive(), ("the claim never granted", box)
    os.kill(worker, signal.SIGKILL)
    thread.join(20)
    wait_for(lambda: node.pids()["workers"][0] not in (None, worker), 20, "a new worker")
    return box[0]


def _assert_never_two_at_once(spans: dict[str, list[tuple[float, float, int]]]) -> None:
    """Per key, (begin, end, lease_id) of every lease anyone held: sorted by
    grant, each ended before the next began."""
    for key, leases in spans.items():
        leases.sort()
        for (_, end, first), (begin, _, second) in itertools.pairwise(leases):
            assert begin >= end - 1e-3, f"{key}: lease {second} granted while {first} lived"


def test_kill_9_of_an_http_worker_mid_claim(nodes):
    """A claim of 2,000 keys is in flight from a thread; the worker serving it
    is killed as soon as the lease table counts its first grant, so the
    leases it granted are never answered. The supervisor restarts the worker;
    those leases expire, their keys are held, then granted again; meanwhile
    another thread samples /leases. No key is ever held by two leases at once,
    everything completes, and the ledger balances (the lost leases are
    exactly the expired ones)."""
    from shm.leases import LeaseTable
    from shm.ready import ReadySet

    n = 2000
    node = nodes()
    client = Client(node.base_url)
    keys = _keys(n, "worker")
    _seed(client, keys)
    with ReadySet.attach(node.name) as ready:
        wait_for(lambda: len(ready.snapshot().entries) == n, 20, f"{n} keys published")
    sampler = _LeaseSampler(node.base_url)
    sampler.start()
    with LeaseTable.attach(node.name) as table:
        answer = _kill_worker_mid_claim(node, table, n, lease_s=2)
        assert isinstance(answer, ClientError) and answer.status == 0, answer
        lost = {x.lease_id: x for x in table.live(limit=n) if x.consumer == "doomed"}
    assert 0 < len(lost) < n, len(lost)  # granted by the dead worker, never answered

    # A consumer takes everything; the lost keys once their leases expired
    # (2 s) and their hold (2 lease lengths) ended.
    ours: dict[int, tuple[str, float, float]] = {}  # lease_id -> key, granted_at, ended by
    completed: Counter[str] = Counter()

    def step() -> bool:
        grants = _call(lambda: client.claim(200, lease_s=60, consumer="survivor"), "a claim")
        for g in grants:
            assert g.key not in completed, f"{g.key} granted after it was finished"
            assert isinstance(client.complete(g.lease_id, g.key, {"k": g.key}), int)
            ours[g.lease_id] = (g.key, g.expires_at - 60, time.time())
            completed[g.key] += 1
        return len(completed) == n

    wait_for(step, 40, "every key completed")
    sampler.finish()
    assert sampler.snapshots > 10

    spans: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    seen = {**sampler.seen, **{x.lease_id: (x.key, x.granted_at, x.expires_at)
                               for x in lost.values()}}  # fmt: skip
    for lease_id, (key, granted_at, expires_at) in seen.items():
        if lease_id not in ours:
            spans[key].append((granted_at, expires_at, lease_id))
    for lease_id, (key, granted_at, ended_by) in ours.items():
        spans[key].append((granted_at, ended_by, lease_id))
    _assert_never_two_at_once(spans)
    assert all(len(spans[x.key]) == 2 for x in lost.values())  # the lost lease, then ours

    _drain(client, set(keys))
    acct = _settled(client, finished=n, acknowledged=n, in_flight=0, awaiting_ack=0)
    assert acct["routed"] == n + len(lost) and acct["expired"] == len(lost), acct
    assert "child_died" in _log(node)
    client.close()
    assert node.stop() == 0


# -- 6. a consumer that stops polling -------------------------------------------------


# 1,000 results of 32 KiB: 31 MiB if the ledger kept them in memory. It keeps
# ids and log positions (tens of bytes a result) and, to offer them without a
# read, the latest results up to CompletionConfig.recent_bytes (8 MiB); the
# rest stay on disk.
RESULT_BYTES = 32 * 1024
# The ledger at rest is a Python process with SQLite, msgpack and the lease
# table's touched pages: ~40-60 MB here. 150 MB leaves room for allocator
# noise and still fails a ledger that holds the backlog twice over.
LEDGER_RSS_MAX = 150 * 1024 * 1024
# Growth from 50 to 1,000 unpolled results: half of what keeping them would cost.
LEDGER_GROWTH_MAX = 16 * 1024 * 1024


def test_a_consumer_that_stops_polling_loses_nothing_and_memory_stays_bounded(nodes):
    n = 1000
    node = nodes()
    client = Client(node.base_url)
    keys = _keys(n, "quiet")
    _seed(client, keys)
    grants = sorted(_claim(client, n, lease_s=300, consumer="gpu").values(),
                    key=lambda g: g.key)  # fmt: skip
    ledger_pid = node.pids()["ledger"]
    ledger = psutil.Process(ledger_pid)

    def result(key: str) -> dict:
        return {"k": key, "blob": key[-1] * RESULT_BYTES}

    for g in grants[:50]:
        client.complete(g.lease_id, g.key, result(g.key))
    rss0 = ledger.memory_info().rss
    for g in grants[50:]:
        client.complete(g.lease_id, g.key, result(g.key))
    rss1 = ledger.memory_info().rss
    acct = _settled(client, routed=n, finished=n, acknowledged=0, awaiting_ack=n, in_flight=0)
    assert node.pids()["ledger"] == ledger_pid  # the same process held them all along
    assert rss1 < LEDGER_RSS_MAX, f"ledger RSS {rss1 >> 20} MiB"
    assert rss1 - rss0 < LEDGER_GROWTH_MAX, (
        f"ledger RSS grew {(rss1 - rss0) >> 20} MiB for {n - 50} unpolled results"
    )

    # A poller finally comes: every result is there, intact, once.
    results = _drain(client, set(keys), per_poll=200)
    for key, r in results.items():
        assert r["result"] == result(key)
    acct = _settled(client, finished=n, acknowledged=n, awaiting_ack=0, in_flight=0)
    assert acct["routed"] == n
    client.close()
    assert node.stop() == 0
