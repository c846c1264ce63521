"""The campaign's clients: a producer, an outside GPU consumer, a receiver.

Each runs in a thread, speaks only the public HTTP API (``node.client.Client``)
and appends every request and its answer to its own JSON-lines log (one line
per event, flushed at once), so the checker sees what happened even when the
run is cut short. They survive restarts of the node: an unreachable node or a
503 is retried with backoff to a deadline, and the node's address is read
again from ``<data-dir>/node.json`` (a restarted node listens on a new port).

Item ``N`` is the row ``c/<N>`` (six digits) with payload ``{"id": N}``, in
job ``a`` or ``b`` (N odd or even), due at once, 30-day cadence: a one-shot
workload, so every item should finish once.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node.client import Client, ClientError

CADENCE_S = 30 * 86400
# A node that cannot be reached (0) or says "retry" (503) is retried.
RETRY_STATUSES = (0, 503)
# Per call: long enough for a node restart (a few seconds here) and a stalled
# ledger, short enough that a stuck run ends.
CALL_DEADLINE_S = 45.0
BACKOFF_MAX_S = 1.0
JOBS = ("a", "b")


def key_of(item: int) -> str:
    return f"c/{item:06d}"


def item_of(key: str) -> int | None:
    if not key.startswith("c/"):
        return None
    try:
        return int(key[2:])
    except ValueError:
        return None


class EventLog:
    """Append-only JSON lines, flushed per event; shared by threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()

    def write(self, ev: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "ev": ev, **fields}) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_log(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a JSON-lines log (a torn last line is skipped)."""
    out = []
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class Endpoint:
    """The node's current address, from node.json; a client per thread."""

    def __init__(self, data_dir: Path, timeout_s: float = 10.0) -> None:
        self.data_dir = data_dir
        self.timeout_s = timeout_s
        self._url: str | None = None
        self._client: Client | None = None

    def client(self) -> Client:
        if self._client is None:
            try:
                doc = json.loads((self.data_dir / "node.json").read_text())
                url = f"http://{doc['http']}"
            except (OSError, ValueError, KeyError):
                raise ClientError(0, "unreachable", "node.json not there (restarting)") from None
            self._url, self._client = url, Client(url, timeout_s=self.timeout_s)
        return self._client

    def forget(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None

    def call(
        self,
        fn: Callable[[Client], Any],
        stop: threading.Event,
        deadline_s: float = CALL_DEADLINE_S,
    ) -> Any:
        """``fn(client)`` until it answers; a retryable refusal is retried with
        backoff to the deadline, then raised. Any other refusal raises."""
        deadline = time.monotonic() + deadline_s
        delay = 0.05
        while True:
            try:
                return fn(self.client())
            except ClientError as exc:
                if exc.status not in RETRY_STATUSES or time.monotonic() >= deadline:
                    raise
                if exc.status == 0:
                    self.forget()
            if stop.wait(delay):  # backoff between retries, cut short by a stop
                raise ClientError(0, "stopped", "the campaign stopped")
            delay = min(delay * 2, BACKOFF_MAX_S)


class Worker(threading.Thread):
    """A thread that records the exception that ended it."""

    def __init__(self, name: str, data_dir: Path, log: EventLog) -> None:
        super().__init__(name=name, daemon=True)
        self.endpoint = Endpoint(data_dir)
        self.log = log
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.body()
        except BaseException as exc:  # noqa: BLE001 - reported by the campaign
            self.error = exc
            self.log.write("crashed", thread=self.name, error=repr(exc))
        finally:
            self.endpoint.forget()

    def body(self) -> None:
        raise NotImplementedError

    def finish(self, timeout_s: float = 60.0) -> None:
        self.stop_event.set()
        self.join(timeout_s)


class Producer(Worker):
    """Writes items 0 .. n-1 in batches of ``batch``, spread over ``load_s``.

    A batch answered 200 is ``ok``; one answered with a dropped connection or
    a 503 is ``maybe`` and is not retried (a retry would make a finished row
    due again); any other answer is ``refused``. The checker decides the
    maybe-written ones from the table."""

    def __init__(
        self, data_dir: Path, log: EventLog, n: int, load_s: float, batch: int = 10
    ) -> None:
        super().__init__("producer", data_dir, log)
        self.n, self.load_s, self.batch = n, load_s, batch
        self.written = 0
        self.done = threading.Event()

    def body(self) -> None:
        start = time.monotonic()
        batches = range(0, self.n, self.batch)
        gap_s = self.load_s / max(1, len(batches))
        for i, first in enumerate(batches):
            if self.stop_event.wait(max(0.0, start + i * gap_s - time.monotonic())):
                break  # pacing the load over load_s
            ids = list(range(first, min(first + self.batch, self.n)))
            self.log.write("write_sent", ids=ids)
            rows = [
                {"key": key_of(x), "route": "r", "cadence_s": CADENCE_S,
                 "due_at": time.time() - 60, "payload": {"id": x}, "job": JOBS[x % 2]}
                for x in ids
            ]  # fmt: skip
            try:
                n = self.endpoint.client().upsert(rows)
                self.log.write("write", ids=ids, outcome="ok" if n == len(ids) else "short", n=n)
            except ClientError as exc:
                outcome = "maybe" if exc.status in RETRY_STATUSES else "refused"
                if exc.status == 0:
                    self.endpoint.forget()
                self.log.write("write", ids=ids, outcome=outcome, status=exc.status,
                               code=exc.code)  # fmt: skip
            self.written = ids[-1] + 1
        self.done.set()


class Outside(Worker):
    """The GPU consumer outside the node: claims over HTTP, "runs" each item
    (now and then slower than its lease, a slow holder), completes it with
    ``{"id", "nonce", "by": "outside"}`` and retries the completion through
    restarts. Logs every claim and every completion's final answer."""

    def __init__(
        self,
        data_dir: Path,
        log: EventLog,
        rng: random.Random,
        lease_s: float,
        slow_p: float = 0.02,
    ) -> None:
        super().__init__("outside", data_dir, log)
        self.rng, self.lease_s, self.slow_p = rng, lease_s, slow_p

    def body(self) -> None:
        while not self.stop_event.is_set():
            try:
                grants = self.endpoint.call(
                    lambda c: c.claim(8, lease_s=self.lease_s, consumer="outside"),
                    self.stop_event,
                )
            except ClientError as exc:
                if exc.code == "stopped":
                    return
                self.log.write("claim_error", status=exc.status, code=exc.code)
                continue
            if not grants:
                self.stop_event.wait(0.2)  # idle pacing: nothing due
                continue
            for g in grants:
                self.log.write("claim", key=g.key, lease_id=g.lease_id)
            for g in grants:
                self._run_one(g)

    def _run_one(self, g: Any) -> None:
        if self.rng.random() < self.slow_p:
            # The fault: a holder slower than its lease. Back within its hold
            # (two lease lengths) the result is late and accepted; after it the
            # key may have been granted again and the result is refused.
            self.stop_event.wait(self.lease_s * self.rng.uniform(1.5, 4.0))
        payload = g.payload if isinstance(g.payload, dict) else {}
        result = {"id": payload.get("id"), "nonce": uuid.uuid4().hex[:12], "by": "outside"}
        self.log.write("run", key=g.key, lease_id=g.lease_id, **result)
        try:
            rid = self.endpoint.call(lambda c: c.complete(g.lease_id, g.key, result),
                                     self.stop_event)  # fmt: skip
            self.log.write("complete", key=g.key, lease_id=g.lease_id, nonce=result["nonce"],
                           rid=rid)  # fmt: skip
        except ClientError as exc:
            self.log.write("complete_refused", key=g.key, lease_id=g.lease_id,
                           nonce=result["nonce"], status=exc.status, code=exc.code)  # fmt: skip


class Receiver(Worker):
    """Polls ``GET /results`` (every job), logs every offer, acks per job
    (retrying a failed ack through restarts). Now and then it "crashes" on a
    first offer: it does not ack it (``skip``), so the offer times out."""

    def __init__(
        self, data_dir: Path, log: EventLog, rng: random.Random, skip_p: float = 0.02
    ) -> None:
        super().__init__("receiver", data_dir, log)
        self.rng, self.skip_p = rng, skip_p
        self.acked: set[int] = set()
        self.seen: dict[int, str] = {}  # result id -> key
        self._lock = threading.Lock()

    def acked_keys(self) -> set[str]:
        with self._lock:
            return {self.seen[rid] for rid in self.acked}

    def body(self) -> None:
        while not self.stop_event.is_set():
            try:
                results = self.endpoint.call(lambda c: c.poll(None, max=200, wait_s=1),
                                             self.stop_event)  # fmt: skip
            except ClientError as exc:
                if exc.code == "stopped":
                    return
                self.log.write("poll_error", status=exc.status, code=exc.code)
                continue
            by_job: dict[str, list[int]] = defaultdict(list)
            for r in results:
                self.log.write("offer", rid=r["id"], key=r["key"], job=r["job"],
                               result=r["result"])  # fmt: skip
                first = r["id"] not in self.seen
                with self._lock:
                    self.seen[r["id"]] = r["key"]
                if first and self.rng.random() < self.skip_p:
                    self.log.write("skip", rid=r["id"])
                    continue
                by_job[r["job"]].append(r["id"])
            for job, ids in by_job.items():
                self._ack(job, ids)

    def _ack(self, job: str, ids: list[int]) -> None:
        sent = time.time()
        try:
            n = self.endpoint.call(lambda c: c.ack(job, ids), self.stop_event)
        except ClientError as exc:
            self.log.write("ack_failed", job=job, ids=ids, sent=sent, status=exc.status,
                           code=exc.code)  # fmt: skip
            return
        with self._lock:
            self.acked.update(ids)
        self.log.write("ack", job=job, ids=ids, sent=sent, acked=n)
