"""The HTTP client of a node, and the type both clients return.

``Client(base_url, token=None, wire="msgpack")`` speaks the HTTP API
(``docs/api.md``), blocking, with the standard library and msgpack (a
dependency of the package; ``wire="json"``: the standard library alone). It
keeps one keep-alive connection (a claim loop would otherwise pay a TCP
handshake per claim) and is safe to share between threads (calls take turns).

The wire: msgpack bodies both ways, bytes raw (no base64), a fifth to a
seventh of JSON's encoding and decoding cost on both sides
(docs/performance.md, "The Python client speaks msgpack"). A body msgpack
cannot carry (an integer past 64 bits) goes as JSON, so the node refuses or
takes it exactly as it would from any JSON caller. The values returned are
the same either way.

``LocalClaimer(name)``, for processes on the node's host, lives in
``node/local.py``; ``node.client.LocalClaimer`` names it too (imported on
first use, so this module alone loads none of the node's server code).

Both return claims as ``Grant(lease_id, key, payload, job, due_at,
expires_at)`` and raise ``ClientError`` for every refusal.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import socket
import threading
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from node.core.config import UNIX_PREFIX
from node.core.errors import ClientError
from node.core.rows import Grant, completions

T = TypeVar("T")

if TYPE_CHECKING:
    from node.local import LocalClaimer

__all__ = ["Client", "ClientError", "FleetClient", "Grant", "LocalClaimer"]

# A call that is not a long poll should be answered well within this.
TIMEOUT_S = 30.0


def _grant(doc: dict[str, Any]) -> Grant:
    return Grant(
        doc["lease_id"],
        doc["key"],
        doc.get("payload"),
        doc["job"],
        doc["due_at"],
        doc["expires_at"],
    )


def _result_body(result: Any, raw: bool) -> dict[str, Any]:
    """A result in a completion's body: bytes raw in msgpack (``raw``),
    base64 in JSON, any other value as it is."""
    if isinstance(result, bytes | bytearray | memoryview):
        if raw:
            return {"result": bytes(result)}
        return {"result": base64.b64encode(bytes(result)).decode("ascii"), "encoding": "base64"}
    return {"result": result}


MSGPACK = "application/msgpack"
WIRES = ("msgpack", "json")


# An item of a batch completion the node refused: (status, code, message),
# as the single form answers it (``POST /complete``, docs/api.md).
_ITEM_REFUSALS = {
    "conflict": (409, "lease_conflict", "the key was granted to another lease since"),
    "unknown": (409, "lease_unknown", "no such lease for this key"),
}


def _item_answer(doc: Any, key: str) -> int | None | ClientError:
    """One item of ``{"items": [{id?, outcome}]}``: the result id (None for
    a repeat the node no longer names) or the refusal."""
    outcome = doc.get("outcome") if isinstance(doc, dict) else None
    if outcome in ("ok", "repeat"):
        return doc.get("id")
    status, code, message = _ITEM_REFUSALS.get(
        str(outcome), (502, "http_error", f"the node answered outcome {outcome!r}")
    )
    return ClientError(status, code, f"{message} (key {key!r})", "lease_id", doc)


# http.client's limits on an answer's head: a line's bytes, and its lines
# (the blank line that ends the head counts, as http.client counts it).
_MAXLINE: int = http.client._MAXLINE  # type: ignore[attr-defined]
_MAXHEADERS: int = http.client._MAXHEADERS  # type: ignore[attr-defined]
# The email package's line ends and its test of a header line: a name of
# printable ASCII but the colon, then a colon (email.feedparser's headerRE).
_LINE_ENDS = re.compile(r"(\r\n|\r|\n)")
_FIELD = re.compile(r"[\041-\071\073-\176]*:")
# A block of plain "Name: value" lines, each ending in CR LF (what servers
# send): its fields by one pattern, the same as the rules below give.
_PLAIN_BLOCK = re.compile(r"(?:[\041-\071\073-\176]+:[^\r\n]*\r\n)*\r\n")
_PLAIN_FIELD = re.compile(r"([\041-\071\073-\176]+):[ \t]*([^\r\n]*)\r\n")


def _read_header_block(fp: Any) -> http.client.HTTPMessage:
    """An answer's header block, read up to its blank line, as the
    ``HTTPMessage`` http.client makes of it, with http.client's limits.
    http.client parses the block with the email package (16 us for an
    answer's four headers; about 4 this way, on every request)."""
    lines = []
    while True:
        line = fp.readline(_MAXLINE + 1)
        if len(line) > _MAXLINE:
            raise http.client.LineTooLong("header line")
        lines.append(line)
        if len(lines) > _MAXHEADERS:
            raise http.client.HTTPException(f"got more than {_MAXHEADERS} headers")
        if line in (b"\r\n", b"\n", b""):
            break
    msg = http.client.HTTPMessage()
    for name, value in _fields(b"".join(lines).decode("iso-8859-1")):
        msg.set_raw(name, value)
    return msg


def _fields(block: str) -> list[tuple[str, str]]:
    """A header block's fields by the email package's rules: lines end at
    CR LF, CR or LF; a line that starts with a space or a tab continues the
    field before it (dropped when there is none); a line with an empty name
    or one that starts with ``From `` is dropped; the first line that is no
    header ends the fields; a value loses its leading blanks and its last
    line end, and keeps the rest as sent."""
    if _PLAIN_BLOCK.fullmatch(block) is not None:
        return _PLAIN_FIELD.findall(block)
    parts = _LINE_ENDS.split(block)
    if len(parts) % 2:
        parts.append("")  # the last line has no end (the answer stopped there)
    fields: list[tuple[str, str]] = []
    name: str | None = None
    value: list[str] = []
    for i in range(0, len(parts), 2):
        text, end = parts[i], parts[i + 1]
        if text[:1] in (" ", "\t"):
            if name is not None:
                value.append(text + end)
            continue
        envelope = text.startswith("From ")
        if not text or not envelope and _FIELD.match(text) is None:
            break  # the blank line, or no header: the fields end here
        colon = text.find(":")
        if colon <= 0 or envelope:
            continue  # no name, or an envelope line: dropped
        if name is not None:
            fields.append((name, "".join(value).rstrip("\r\n")))
        name, value = text[:colon], [text[colon + 1 :].lstrip(" \t") + end]
    if name is not None:
        fields.append((name, "".join(value).rstrip("\r\n")))
    return fields


class _Response(http.client.HTTPResponse):
    """``http.client.HTTPResponse`` whose header block is read by
    ``_read_header_block``; the rest (status line, chunked bodies, when the
    connection closes, the length) decided as ``HTTPResponse.begin``
    decides it."""

    def begin(self) -> None:
        if self.headers is not None:
            return
        while True:
            version, status, reason = self._read_status()  # type: ignore[attr-defined]
            if status != http.client.CONTINUE:
                break
            _read_header_block(self.fp)  # a 100 Continue's own headers
        self.code = self.status = status
        self.reason = reason.strip()
        if version in ("HTTP/1.0", "HTTP/0.9"):
            self.version = 10
        elif version.startswith("HTTP/1."):
            self.version = 11
        else:
            raise http.client.UnknownProtocol(version)
        self.headers = self.msg = _read_header_block(self.fp)
        encoding = self.headers.get("transfer-encoding")
        self.chunked = bool(encoding) and encoding.lower() == "chunked"
        self.chunk_left = None
        self.will_close = self._check_close()  # type: ignore[attr-defined]
        self.length = None
        length = self.headers.get("content-length")
        if length and not self.chunked:
            try:
                n = int(length)
            except ValueError:
                n = -1
            self.length = n if n >= 0 else None
        if status in (204, 304) or 100 <= status < 200 or self._method == "HEAD":  # type: ignore[attr-defined]
            self.length = 0
        if not self.will_close and not self.chunked and self.length is None:
            self.will_close = True  # read to the end: the connection closes


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

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout_s: float = TIMEOUT_S,
        wire: str = "msgpack",
    ) -> None:
        if wire not in WIRES:
            raise ValueError(f"wire {wire!r} is not one of {', '.join(WIRES)}")
        self._unix: str | None = None
        if base_url.startswith(UNIX_PREFIX):
            self._unix = base_url[len(UNIX_PREFIX) :]
            if not self._unix.startswith("/"):
                raise ValueError(f"base_url {base_url!r} is not unix:/absolute/path")
            parts = urllib.parse.urlsplit("http://localhost")
        else:
            parts = urllib.parse.urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"base_url {base_url!r} is not http(s)://host:port or unix:/path")
        self.base_url = base_url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self.wire = wire
        self._msgpack: Any = None  # the module, when the wire is msgpack
        if wire == "msgpack":
            import msgpack

            self._msgpack = msgpack
        self._headers = {"Accept": MSGPACK if wire == "msgpack" else "application/json"}
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
        self._conn.response_class = _Response
        self._conn_pid = os.getpid()
        return self._conn, False

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(
        self, method: str, path: str, body: Any = None, timeout_s: float | None = None
    ) -> Any:
        """One request; the decoded answer (JSON or msgpack, as the node
        answered). Raises ClientError for an error answer, and for a node
        that cannot be reached (status 0, code ``unreachable``)."""
        headers = dict(self._headers)
        data = None
        if body is not None:
            data, headers["Content-Type"] = self._encode(body)
        with self._lock:
            status, content_type, raw = self._send(
                method, self._prefix + path, data, headers, timeout_s
            )
            sent_msgpack = headers.get("Content-Type") == MSGPACK
            if status == 400 and sent_msgpack and b"invalid_msgpack" in raw:
                # What msgpack took and the node's strict reading did not (a
                # map key that is no str): the body in JSON, as the old wire
                # sent it (a 400 applied nothing).
                data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
                status, content_type, raw = self._send(
                    method, self._prefix + path, data, headers, timeout_s
                )
        try:
            if not raw:
                doc = None
            elif content_type.startswith(MSGPACK) and self._msgpack is not None:
                doc = self._msgpack.unpackb(raw, raw=False)
            else:
                doc = json.loads(raw)
        except ValueError:  # (msgpack's errors are ValueErrors too)
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

    def _encode(self, body: Any) -> tuple[bytes, str]:
        """The body and its content type: msgpack on that wire, unless
        msgpack cannot carry it (then JSON, which the node judges)."""
        if self._msgpack is not None:
            try:
                return self._msgpack.packb(body, use_bin_type=True), MSGPACK
            except (TypeError, ValueError, OverflowError):
                pass
        return json.dumps(body).encode(), "application/json"

    def _send(
        self,
        method: str,
        path: str,
        data: bytes | None,
        headers: dict[str, str],
        timeout_s: float | None,
    ) -> tuple[int, str, bytes]:
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
            return resp.status, resp.getheader("Content-Type", ""), raw
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
        body = {"lease_id": lease_id, "key": key, **_result_body(result, self._msgpack is not None)}
        return self.request("POST", "/complete", body)["id"]

    def complete_many(self, items: list[Any]) -> list[int | None | ClientError]:
        """Several results ``(lease_id, key, result)`` (or dicts of the three,
        as the HTTP form's items) in one ``POST
        /complete`` (``{"items": [...]}``; they share one group commit): per
        item, its result id or the ClientError ``complete`` would raise
        (409 ``lease_conflict`` or ``lease_unknown``). A refusal of the whole
        request raises: 400 for a malformed item (its field is
        ``items[i].<name>``; nothing was written), 503 (``log_unavailable``,
        ``ledger_unavailable``: send it all again, what was accepted answers
        as a repeat). At most 10,000 items and a 16 MiB body a call."""
        items = completions(items)
        if not items:
            return []
        raw = self._msgpack is not None
        body = {
            "items": [
                {"lease_id": lease_id, "key": key, **_result_body(result, raw)}
                for lease_id, key, result in items
            ]
        }
        answer = self.request("POST", "/complete", body)
        found = answer.get("items") if isinstance(answer, dict) else None
        if not isinstance(found, list) or len(found) != len(items):
            raise ClientError(
                502, "http_error", f"POST /complete answered no outcome per item: {answer!r:.200}"
            )
        return [_item_answer(doc, key) for (_, key, _), doc in zip(items, found, strict=True)]

    def release(self, lease_id: int, key: str, error: str | None = None) -> None:
        body: dict[str, Any] = {"lease_id": lease_id, "key": key}
        if error is not None:
            body["error"] = error
        self.request("POST", "/release", body)

    def renew(self, lease_id: int, key: str, lease_s: float) -> float:
        """The lease's new expires_at."""
        body = {"lease_id": lease_id, "key": key, "lease_s": lease_s}
        return self.request("POST", "/renew", body)["expires_at"]

    def poll(
        self, job: str | None, max: int = 100, wait_s: float = 0, scope: str | None = None
    ) -> list[dict[str, Any]]:
        """Offer up to ``max`` ready results of ``job`` (None: every job),
        waiting up to ``wait_s`` for the first. Bytes results come back as
        bytes. ``scope="cluster"``: from every live node of the fleet."""
        params: dict[str, Any] = {"max": max, "wait_s": wait_s}
        if scope is not None:
            params["scope"] = scope
        query = urllib.parse.urlencode(params)
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

    def accounting(self, scope: str | None = None) -> dict[str, Any]:
        """``GET /accounting`` (``scope="cluster"``: every live node's, summed)."""
        return self.request("GET", "/accounting" + ("" if scope is None else f"?scope={scope}"))

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

    def pause(self, route: str | None = None, node: str | None = None) -> dict[str, Any]:
        """Stop granting ``route``'s rows (None: every row of the node; on a
        fleet a route is paused on every node); it survives a restart.
        ``node``: another node of the fleet, whose every row is paused (asked
        through this one). ``{"paused": {"node", "routes"}, "applied",
        "node"}``: ``applied`` is false when the keeper did not confirm in
        time (it then applies the pause at its next state write)."""
        return self.request("POST", "/admin/pause", _pause_body(route, node))

    def resume(self, route: str | None = None, node: str | None = None) -> dict[str, Any]:
        """Undo ``pause(route, node)``; resuming the node leaves paused routes paused."""
        return self.request("POST", "/admin/resume", _pause_body(route, node))

    def run_now(self, route: str | None = None, job: str | None = None) -> dict[str, Any]:
        """Make every row of ``route`` or of ``job`` (exactly one) due now, on
        a fleet every node's: ``{"rescheduled": n}`` (docs/fleet.md, "Run
        again now")."""
        body = {"route": route} if route is not None else {"job": job}
        return self.request("POST", "/admin/run-now", body)


def _pause_body(route: str | None, node: str | None) -> dict[str, str]:
    body = {} if route is None else {"route": route}
    return body if node is None else {**body, "node": node}


class FleetClient:
    """A receiver's client for a fleet: the whole fleet's results, state and
    books through whichever of its nodes answers.

    ``FleetClient(urls=[...])`` or ``FleetClient(database="postgresql://…")``
    (the live nodes' addresses read from the node list, again whenever no
    node answers). Each call goes to one node, which asks the others
    (``?scope=cluster``; an ack is routed by the node numbers in its ids,
    every share checked on its node before any is acked: docs/fleet.md,
    "Results from the whole fleet"); a node that cannot be reached is
    skipped for the next. Raises ClientError as ``Client`` does (status 0,
    ``unreachable``: no node answered)."""

    def __init__(
        self,
        urls: list[str] | None = None,
        token: str | None = None,
        timeout_s: float = TIMEOUT_S,
        database: str | None = None,
        membership_timeout_s: float = 10.0,
    ) -> None:
        if not urls and not database:
            raise ValueError("a FleetClient needs urls or the fleet's database")
        self.token = token
        self.timeout_s = timeout_s
        self.database = database
        self.membership_timeout_s = membership_timeout_s
        self._clients = [Client(u, token, timeout_s) for u in urls or []]
        self._next = 0

    def _discover(self) -> None:
        """The live nodes from the node list (by the database's clock)."""
        from node.fleet import Membership

        with Membership(self.database or "", "fleet-client", "",
                        membership_timeout_s=self.membership_timeout_s) as membership:  # fmt: skip
            live = membership.live()
        self.close()
        scheme = "https" if any(c.base_url.startswith("https:") for c in self._clients) else "http"
        self._clients = [
            Client(m.address if m.address.startswith(UNIX_PREFIX) else f"{scheme}://{m.address}",
                   self.token, self.timeout_s)
            for m in live.members
        ]  # fmt: skip

    def _call(self, fn: Callable[[Client], T]) -> T:
        if not self._clients and self.database:
            self._discover()
        last: ClientError | None = None
        for rediscover in (False, True):
            if rediscover:
                if not self.database:
                    break
                self._discover()
            for _ in range(len(self._clients)):
                client = self._clients[self._next % len(self._clients)]
                try:
                    return fn(client)
                except ClientError as exc:
                    if exc.status != 0:
                        raise
                    last = exc
                    self._next += 1
        raise last or ClientError(0, "unreachable", "no node of the fleet is known")

    def poll(self, job: str | None, max: int = 100, wait_s: float = 0) -> list[dict[str, Any]]:
        """Up to ``max`` results of ``job`` (None: every job) from the fleet."""
        return self._call(lambda c: c.poll(job, max, wait_s, scope="cluster"))

    def ack(self, job: str, ids: list[int]) -> int:
        """Ack ``ids`` wherever each was made; raises ClientError 409 (an id
        never offered: nothing acked) or 503 ``peer_unavailable`` (a node
        holding some is down: send the same ack again later)."""
        return self._call(lambda c: c.ack(job, ids))

    def queue_state(self) -> dict[str, Any]:
        """The fleet's queue state (503: returned, ``trust.vouched`` false)."""
        return self._call(lambda c: c.queue_state(scope="cluster"))

    def accounting(self) -> dict[str, Any]:
        """Every node's books, summed."""
        return self._call(lambda c: c.accounting(scope="cluster"))

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def __getattr__(name: str) -> Any:
    """``node.client.LocalClaimer``, the contract's import path: the class
    is in ``node/local.py`` and is imported the first time it is asked for."""
    if name == "LocalClaimer":
        from node.local import LocalClaimer

        return LocalClaimer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
