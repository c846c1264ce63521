"""Python clients of a node: ``Client`` over HTTP, ``LocalClaimer`` on the host.

``Client(base_url, token=None)`` speaks the HTTP API (``docs/api.md``),
blocking, standard library only. It keeps one keep-alive connection (a claim
loop would otherwise pay a TCP handshake per claim) and is safe to share
between threads (calls take turns).

``LocalClaimer(name)`` is for processes on the node's host (the inference
processes, a local GPU worker): claims come straight from the node's shared
memory through ``workers.claim.Claimer`` (no network hop), completions go to
the ledger over its local socket. The rules are the HTTP endpoints' rules, and
a refusal raises the same ``ClientError`` (status and code) that the HTTP
answer would.

Both return claims as ``Grant(lease_id, key, payload, job, due_at,
expires_at)`` and raise ``ClientError`` for every refusal.

How LocalClaimer finds the node: it needs the node's resolved configuration
(the store URL, the routes' cadences), which the supervisor writes to
``<data-dir>/run/config.json``. It looks, in order, at ``data_dir`` if given,
``$QUEUE_NODE_RUN_CONFIG`` (set for every process the supervisor starts),
``$QUEUE_NODE_DATA_DIR``, then ``./node-data`` (the default data directory),
and uses the first whose configuration names this node. Anything else:
``NodeNotRunning`` saying where it looked.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.config import UNIX_PREFIX, Config
from node.core.errors import NodeError, NodeNotRunning, NodeRestarted, ValidationError
from node.core.proc import ENV_CONFIG
from node.core.rows import check_key
from shm.leases import SlotTakenOver
from workers.claim import (
    Claimer,
    Grant,
    NotReady,
    WorkError,
    check_claim,
    check_lease_id,
    check_lease_s,
    complete_outcome,
    ledger_address,
    ledger_error,
    refuse,
)

if TYPE_CHECKING:
    from shm.leases import Outcome

# A LocalClaimer waiting for a publish looks at its node's seal this often.
RESTART_CHECK_S = 0.25
# A call that is not a long poll should be answered well within this.
TIMEOUT_S = 30.0
ENV_DATA_DIR = "QUEUE_NODE_DATA_DIR"
DEFAULT_DATA_DIR = Path("node-data")


class ClientError(NodeError):
    """The node refused a request: ``status`` (the HTTP status), ``code``
    (the stable error code of ``docs/api.md``), ``message``, ``field``;
    ``body`` is the whole answer when there was one."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}" + (f" ({field})" if field else ""))
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.body = body


def _grant(doc: dict[str, Any]) -> Grant:
    return Grant(
        doc["lease_id"],
        doc["key"],
        doc.get("payload"),
        doc["job"],
        doc["due_at"],
        doc["expires_at"],
    )


def _result_body(result: Any) -> dict[str, Any]:
    if isinstance(result, bytes | bytearray | memoryview):
        return {"result": base64.b64encode(bytes(result)).decode("ascii"), "encoding": "base64"}
    return {"result": result}


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a node's socket file (``--http unix:PATH``)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.unix_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class Client:
    """The HTTP API, blocking. ``base_url`` like ``http://127.0.0.1:8470``."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = TIMEOUT_S):
        self._unix: str | None = None
        if base_url.startswith(UNIX_PREFIX):
            self._unix = base_url[len(UNIX_PREFIX) :]
            if not self._unix.startswith("/"):
                raise ValueError(f"base_url {base_url!r} is not unix:/absolute/path")
            parts = urllib.parse.urlsplit("http://localhost")
        else:
            parts = urllib.parse.urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"base_url {base_url!r} is not http(s)://host:port or unix:/path"
                )
        self.base_url = base_url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None
        self._conn_pid = 0  # a connection never crosses a fork
        self._lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------

    def _connection(self, timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
        """(connection, reused)."""
        if self._conn is not None and self._conn_pid == os.getpid():
            self._conn.timeout = timeout_s
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout_s)
            return self._conn, True
        if self._unix is not None:
            self._conn = _UnixConnection(self._unix, timeout_s)
        else:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=timeout_s)
        self._conn_pid = os.getpid()
        return self._conn, False

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(
        self, method: str, path: str, body: Any = None, timeout_s: float | None = None
    ) -> Any:
        """One request; the decoded JSON answer. Raises ClientError for an
        error answer, and for a node that cannot be reached (status 0,
        code ``unreachable``)."""
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        with self._lock:
            status, raw = self._send(method, self._prefix + path, data, headers, timeout_s)
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            doc = None
        if 200 <= status < 300:
            return doc
        error = doc.get("error") if isinstance(doc, dict) else None
        if not isinstance(error, dict):
            text = raw[:200].decode("utf-8", "replace")
            raise ClientError(status, "http_error", f"{method} {path}: {text}", body=doc)
        raise ClientError(
            status, error.get("code", "error"), error.get("message", ""), error.get("field"), doc
        )

    def _send(
        self,
        method: str,
        path: str,
        data: bytes | None,
        headers: dict[str, str],
        timeout_s: float | None,
    ) -> tuple[int, bytes]:
        for attempt in (1, 2):
            conn, reused = self._connection(timeout_s or self.timeout_s)
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                self._drop()
                # A kept-alive connection the server closed while idle fails
                # before the request is read: send it once more, afresh.
                if reused and attempt == 1:
                    continue
                raise ClientError(0, "unreachable", f"{self.base_url}: {exc!r}") from None
            except (OSError, http.client.HTTPException) as exc:
                self._drop()
                raise ClientError(0, "unreachable", f"{self.base_url}: {exc!r}") from None
            if resp.will_close:
                self._drop()
            return resp.status, raw
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- rows -----------------------------------------------------------------------

    def upsert(self, rows: list[dict[str, Any]]) -> int:
        return self.request("POST", "/rows", rows)["upserted"]

    def delete(self, keys: list[str]) -> int:
        return self.request("POST", "/rows/delete", {"keys": keys})["deleted"]

    def row(self, key: str) -> dict[str, Any]:
        """``GET /rows?key=``: the row, the keeper's view and the lease's."""
        return self.request("GET", "/rows?" + urllib.parse.urlencode({"key": key}))

    # -- the work path -------------------------------------------------------------

    def claim(
        self, max: int, lease_s: float | None = None, consumer: str = "python"
    ) -> list[Grant]:
        body: dict[str, Any] = {"max": max, "consumer": consumer}
        if lease_s is not None:
            body["lease_s"] = lease_s
        return [_grant(doc) for doc in self.request("POST", "/claim", body)["leases"]]

    def complete(self, lease_id: int, key: str, result: Any) -> int:
        """Hand in a lease's result (bytes or a JSON value); the result id."""
        body = {"lease_id": lease_id, "key": key, **_result_body(result)}
        return self.request("POST", "/complete", body)["id"]

    def release(self, lease_id: int, key: str, error: str | None = None) -> None:
        body: dict[str, Any] = {"lease_id": lease_id, "key": key}
        if error is not None:
            body["error"] = error
        self.request("POST", "/release", body)

    def renew(self, lease_id: int, key: str, lease_s: float) -> float:
        """The lease's new expires_at."""
        body = {"lease_id": lease_id, "key": key, "lease_s": lease_s}
        return self.request("POST", "/renew", body)["expires_at"]

    def poll(self, job: str | None, max: int = 100, wait_s: float = 0) -> list[dict[str, Any]]:
        """Offer up to ``max`` ready results of ``job`` (None: every job),
        waiting up to ``wait_s`` for the first. Bytes results come back as bytes."""
        query = urllib.parse.urlencode({"max": max, "wait_s": wait_s})
        path = "/results" if job is None else f"/jobs/{urllib.parse.quote(job, safe='')}/results"
        found = self.request("GET", f"{path}?{query}", timeout_s=self.timeout_s + wait_s)
        results = found["results"]
        for item in results:
            if item.pop("encoding", None) == "base64":
                item["result"] = base64.b64decode(item["result"])
        return results

    def ack(self, job: str, ids: list[int]) -> int:
        path = f"/jobs/{urllib.parse.quote(job, safe='')}/ack"
        return self.request("POST", path, {"ids": ids})["acked"]

    def leases(self, limit: int = 1000) -> list[dict[str, Any]]:
        return self.request("GET", f"/leases?limit={limit}")["leases"]

    def held(self, limit: int = 1000) -> list[dict[str, Any]]:
        return self.request("GET", f"/held?limit={limit}")["held"]

    def unhold(self, keys: list[str]) -> int:
        return self.request("POST", "/admin/unhold", {"keys": keys})["unheld"]

    def accounting(self) -> dict[str, Any]:
        return self.request("GET", "/accounting")

    def queue_state(self, scope: str | None = None) -> dict[str, Any]:
        """``GET /queue-state`` (``scope="cluster"``: the fleet's). A 503 that
        carries a queue state is returned, not raised: the keeper cannot vouch,
        ``doc["trust"]["vouched"]`` is false (with ``trust.reason``) and the
        document has no counts, only ``trust`` and ``now: {in_flight, paused,
        status}``. Every other error raises ``ClientError`` (a bad scope:
        400 ``invalid_scope``)."""
        path = "/queue-state"
        if scope is not None:
            path += "?" + urllib.parse.urlencode({"scope": scope})
        try:
            return self.request("GET", path)
        except ClientError as exc:
            if exc.status == 503 and isinstance(exc.body, dict) and "trust" in exc.body:
                return exc.body
            raise

    def pause(self, route: str | None = None) -> dict[str, Any]:
        """Stop granting ``route``'s rows (None: every row of the node); it
        survives a restart. ``{"paused": {"node", "routes"}, "applied"}``:
        ``applied`` is false when the keeper did not confirm in time (it then
        applies the pause at its next state write)."""
        return self.request("POST", "/admin/pause", {} if route is None else {"route": route})

    def resume(self, route: str | None = None) -> dict[str, Any]:
        """Undo ``pause(route)``; resuming the node leaves paused routes paused."""
        return self.request("POST", "/admin/resume", {} if route is None else {"route": route})


# -- on the host -----------------------------------------------------------------------


def find_config(name: str, data_dir: str | os.PathLike[str] | None = None) -> Config:
    """The running node's resolved configuration (see the module docstring)."""
    candidates: list[Path] = []
    if data_dir is not None:
        candidates.append(Path(data_dir) / "run" / "config.json")
    else:
        if os.environ.get(ENV_CONFIG):
            candidates.append(Path(os.environ[ENV_CONFIG]))
        if os.environ.get(ENV_DATA_DIR):
            candidates.append(Path(os.environ[ENV_DATA_DIR]) / "run" / "config.json")
        candidates.append(DEFAULT_DATA_DIR / "run" / "config.json")
    for path in candidates:
        try:
            config = Config.from_json(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if config.name == name:
            return config
    tried = ", ".join(str(p) for p in candidates)
    raise NodeNotRunning(
        f"no run configuration of node {name!r} found (tried {tried}); pass data_dir= "
        "the node's --data-dir"
    )


def _from_work(exc: WorkError) -> ClientError:
    return ClientError(exc.status, exc.code, exc.message, exc.field)


def _from_validation(exc: ValidationError) -> ClientError:
    return ClientError(400, exc.code, exc.message, exc.field)


def _encode(result: Any) -> tuple[bytes, str]:
    """A result as the ledger takes it: bytes raw, anything else as JSON text."""
    if isinstance(result, bytes | bytearray | memoryview):
        return bytes(result), "bytes"
    try:
        return json.dumps(result, separators=(",", ":"), allow_nan=False).encode(), "json"
    except (TypeError, ValueError, RecursionError) as exc:
        raise ClientError(400, "invalid_result", f"not a JSON value: {exc}", "result") from None


def _check_lease(lease_id: Any, key: Any) -> None:
    try:
        check_lease_id(lease_id)
        check_key(key)
    except ValidationError as exc:
        raise _from_validation(exc) from None


class LocalClaimer:
    """Claims straight from the shared memory of node ``name`` on this host.

    One per thread (a claim is not thread-safe). ``close()`` when done: it
    unmaps the segments and closes the store and the ledger connection;
    nothing is unlinked (only the supervisor does that).

    Across restarts of the node: a clean stop seals the lease table before it
    saves the leases, so nothing can be granted, renewed or released in it
    any more. A call that meets the seal (or finds nothing to claim in a
    sealed table) reattaches to the new node's segments, told apart by their
    boot id, and goes on there; while no new node is up it raises
    ``ClientError(503, "node_restarted")`` and tries again at the next call.
    After a kill -9 the restarted node reattaches the same segments, which
    are not sealed: an attached claimer goes on as it was.
    """

    def __init__(
        self,
        name: str,
        data_dir: str | os.PathLike[str] | None = None,
        consumer: str | None = None,
    ) -> None:
        from node.ipc import Client as IpcClient

        self.name = name
        self._data_dir = data_dir
        self.consumer = consumer or f"local-{os.getpid()}"
        self._opened: list[Any] = []
        self._attach()
        self.ledger = IpcClient(ledger_address(name))

    def _attach(self) -> None:
        """Map the node's segments and open its store; ``boot_id`` is the
        boot these belong to. Raises NodeNotRunning (or NameTaken for names
        that are not this user's node's)."""
        from node.core.identity import data_dir_id
        from node.store import open_store
        from shm.leases import LeaseTable
        from shm.ready import ReadySet
        from shm.state import StateBuffer, boot_id
        from shm.wake import Wake

        self.config = find_config(self.name, self._data_dir)
        ident = data_dir_id(self.config.data_dir)
        try:
            self.state = self._open(StateBuffer.attach(self.name, data_dir_id=ident))
            self.boot_id = boot_id(self.state.segment)
            self.ready = self._open(ReadySet.attach(self.name))
            self.leases = self._open(LeaseTable.attach(self.name))
            self.wake = self._open(Wake.attach(self.name))
            self.store = self._open(open_store(self.config.store_url))
        except BaseException:
            self._detach()
            raise
        self.claimer = Claimer(
            self.config,
            self.store,
            self.ready,
            self.leases,
            wake=self.wake.post,
            is_ready=self._keeper_published,
        )

    def _detach(self) -> None:
        while self._opened:
            try:
                self._opened.pop().close()
            except (OSError, BufferError, NodeError):
                pass  # a mapping of a node that is gone: nothing to flush

    def _open(self, obj: Any) -> Any:
        self._opened.append(obj)
        return obj

    def _restarted(self) -> bool:
        """Whether the node these segments belong to has stopped (sealed at
        its clean stop), or its names now lead elsewhere (a restart after a
        kill -9 that had to make a segment anew, say for a new ready_size)."""
        if not self._opened:
            return False
        if self.leases.sealed:
            return True
        return not all(
            seg.segment.still_named() for seg in (self.state, self.ready, self.leases)
        )

    def _reattach(self) -> None:
        """Move to the new node's segments, or ClientError 503 node_restarted
        while there is none (or only the old one's, sealed, still named)."""
        old_boot = getattr(self, "boot_id", None)
        self._detach()
        try:
            self._attach()
        except NodeError as exc:
            raise ClientError(
                503, "node_restarted",
                f"node {self.name!r} restarted and no new node is up yet: {exc}",
            ) from None  # fmt: skip
        if self.leases.sealed or self.boot_id == old_boot:
            self._detach()
            raise ClientError(503, "node_restarted",
                              f"node {self.name!r} is stopping; its next start is not up yet")

    def _current(self) -> None:
        """Reattach first when the last call found the node gone."""
        if not self._opened:
            self._reattach()

    def _keeper_published(self) -> bool:
        state = self.state.read()
        first = state.get("first_publish_at") or 0.0
        return first > 0 and first >= state.get("started_at", 0.0)

    def claim(
        self,
        max: int,
        lease_s: float | None = None,
        consumer: str | None = None,
        wait_s: float = 0.0,
    ) -> list[Grant]:
        """Up to ``max`` leases, most overdue first. With ``wait_s``, a claim
        that finds nothing waits for the keeper's next publish (up to
        ``wait_s`` in all) and tries again."""
        try:
            max_n, lease_s, consumer = check_claim(
                max, self.config.lease_s if lease_s is None else lease_s, consumer or self.consumer
            )
        except ValidationError as exc:
            raise _from_validation(exc) from None
        deadline = time.monotonic() + wait_s
        self._current()
        while True:
            generation = self.claimer.generation
            try:
                grants = self.claimer.claim(max_n, lease_s, consumer, time.time())
            except NotReady as exc:
                if self._restarted():
                    self._reattach()
                    continue
                raise ClientError(503, "not_ready", str(exc)) from None
            except (NodeRestarted, SlotTakenOver):
                # SlotTakenOver: a stop of the node took back a slot this
                # process held past the seal's deadline (stopped meanwhile).
                if not self._restarted():
                    raise
                self._reattach()
                continue
            if not grants and self._restarted():
                self._reattach()
                continue
            left = deadline - time.monotonic()
            if grants or left <= 0:
                return grants
            # In slices: a node that stops publishes nothing more, and a
            # waiter must notice the seal.
            self.claimer.wait_for_publish(generation, min(left, RESTART_CHECK_S))

    def complete(self, lease_id: int, key: str, result: Any) -> int:
        """Hand in a lease's result (bytes or a JSON value), answered once it
        is durable; the result id."""
        (answer,) = self.complete_many([(lease_id, key, result)])
        if isinstance(answer, ClientError):
            raise answer
        return answer

    def complete_many(self, items: list[tuple[int, str, Any]]) -> list[int | ClientError]:
        """Several results ``(lease_id, key, result)`` in one ledger request
        (they share one group commit): per item, its result id or the
        ClientError ``complete`` would raise. Raises ClientError (400) when an
        item is malformed (nothing is sent), and 503 ``ledger_unavailable``
        when the ledger cannot be reached (nothing is known to be accepted)."""
        from node.ipc import IpcError, RemoteError

        request = []
        for lease_id, key, result in items:
            _check_lease(lease_id, key)
            data, encoding = _encode(result)
            request.append({"lease_id": lease_id, "key": key, "result": data, "encoding": encoding})
        if not request:
            return []
        try:
            answer = self.ledger.call("complete", items=request)
        except IpcError as exc:
            if self._opened and self._restarted():
                raise ClientError(503, "node_restarted",
                                  f"node {self.name!r} restarted: {exc}; send it again") from None
            raise ClientError(503, "ledger_unavailable", str(exc)) from None
        except RemoteError as exc:
            raise _from_work(ledger_error(exc.code, exc.message)) from None
        outcomes = answer.get("outcomes") or []
        if len(outcomes) != len(request):
            raise ClientError(503, "ledger_unavailable", "the ledger answered the wrong count")
        out: list[int | ClientError] = []
        for (_lease_id, key, _result), outcome in zip(items, outcomes, strict=True):
            try:
                out.append(complete_outcome(outcome, key))  # type: ignore[arg-type]
            except WorkError as exc:
                out.append(_from_work(exc))
        return out

    def release(self, lease_id: int, key: str, error: str | None = None) -> None:
        _check_lease(lease_id, key)
        if error is not None and not isinstance(error, str):
            raise ClientError(400, "invalid_error", "error must be a string (or None)", "error")
        outcome = self._on_current(lambda: self.claimer.release(key, lease_id, time.time(), error))
        if outcome.value != "released":
            raise _from_work(refuse(outcome, key))

    def renew(self, lease_id: int, key: str, lease_s: float) -> float:
        """The lease's new expires_at."""
        _check_lease(lease_id, key)
        try:
            lease_s = check_lease_s(lease_s)
        except ValidationError as exc:
            raise _from_validation(exc) from None
        now = time.time()
        outcome = self._on_current(lambda: self.claimer.renew(key, lease_id, lease_s, now))
        if outcome.value != "renewed":
            raise _from_work(refuse(outcome, key))
        return now + lease_s

    def _on_current(self, change: Callable[[], Outcome]) -> Outcome:
        """Run a lease change in the current node's table: one that meets the
        seal of a stopped node runs again in the new node's (its leases were
        saved and loaded there), never in the old one."""
        self._current()
        try:
            return change()
        except (NodeRestarted, SlotTakenOver):
            if not self._restarted():
                raise
            self._reattach()
            return change()

    def close(self) -> None:
        ledger = getattr(self, "ledger", None)
        if ledger is not None:
            ledger.close()
        self._detach()

    def __enter__(self) -> LocalClaimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
