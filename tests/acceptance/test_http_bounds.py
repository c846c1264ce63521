"""Bounds on what a caller can make the node hold (security review, part 6).

Each bound of docs/api.md, "Bounds", hit against a real ``python -m node``
(node/testing.py) over real sockets, and answered as documented:

- a claim answer stops at ``claim_answer_bytes``; the leases past it are
  handed back, not left leased;
- long polls waiting at once past ``max_poll_waiters``: 429; and the ledger
  forgets a job name once the last long poll on it has left;
- connections past ``max_connections``: 503 and closed at once;
- an idle keep-alive connection is closed after ``keepalive_s``;
- a request whose headers trickle in is cut after ``header_timeout_s``;
- with a token, every route but health, readiness, metrics and the console's
  files needs it (the route table walked, so a new route cannot escape; the
  console's use of it is tests/acceptance/test_console.py's browser test);
- ``--http unix:PATH``: an owner-only socket file that serves.

Waits are on the socket (a recv with a deadline) or ``wait_for`` polls; the
trickle's pauses are the behaviour under test, and each is a recv that
would see the node's answer as soon as it came.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from node.config import Config, load_config
from node.core.errors import ConfigError
from node.testing import ROOT, NodeProcess, finish, wait_for

pytestmark = pytest.mark.timeout(120)

TOKEN = "bounds-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CLAIM_ANSWER_BYTES = 65_536
MAX_CONNECTIONS = 4
MAX_POLL_WAITERS = 2
HEADER_TIMEOUT_S = 1.0
KEEPALIVE_S = 2.0
DOCS = ROOT / "docs" / "api.md"


# -- raw HTTP ------------------------------------------------------------------------


def _address(node: NodeProcess) -> tuple[str, int]:
    host, port = node.node_json()["http"].rsplit(":", 1)
    return host, int(port)


def _connect(node: NodeProcess, timeout_s: float = 10.0) -> socket.socket:
    return socket.create_connection(_address(node), timeout=timeout_s)


def _read_answer(sock: socket.socket, deadline_s: float) -> tuple[int, dict[str, str], bytes]:
    """One HTTP answer off ``sock``: (status, headers, body). Raises
    AssertionError when none is complete by the deadline."""
    data = b""
    end = time.monotonic() + deadline_s
    while True:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            lines = head.decode("latin-1").split("\r\n")
            headers = dict(line.split(": ", 1) for line in lines[1:])
            length = int(headers.get("Content-Length", "0"))
            if len(rest) >= length:
                return int(lines[0].split()[1]), headers, rest[:length]
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no whole answer within {deadline_s} s: {data[:300]!r}")
        sock.settimeout(left)
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"closed before a whole answer: {data[:300]!r}")
        data += chunk


def _closed_within(sock: socket.socket, deadline_s: float) -> bool:
    """Whether the node closes ``sock`` within the deadline (bytes before
    the close are read and dropped)."""
    end = time.monotonic() + deadline_s
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
    return False


def _error_code(body: bytes) -> str:
    doc = json.loads(body)
    assert set(doc) == {"error"} and set(doc["error"]) == {"code", "message", "field"}, doc
    return doc["error"]["code"]


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


# -- nodes ---------------------------------------------------------------------------


def _node(tmp: Path, *args: str, env: dict[str, str] | None = None) -> NodeProcess:
    return NodeProcess(tmp / "data", f"t-{uuid.uuid4().hex[:12]}", *args, env=env)


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node with a token and small bounds, shared by the tests below."""
    node = _node(
        tmp_path_factory.mktemp("bounded"),
        "--token", TOKEN,
        env={
            "QUEUE_NODE_CLAIM_ANSWER_BYTES": str(CLAIM_ANSWER_BYTES),
            "QUEUE_NODE_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
            "QUEUE_NODE_MAX_POLL_WAITERS": str(MAX_POLL_WAITERS),
            "QUEUE_NODE_PUBLISH_INTERVAL_S": "0.2",
        },
    )  # fmt: skip
    try:
        yield node.start()
    finally:
        finish([node], node.name)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node with short connection timeouts."""
    node = _node(
        tmp_path_factory.mktemp("quick"),
        env={
            "QUEUE_NODE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
            "QUEUE_NODE_KEEPALIVE_S": str(KEEPALIVE_S),
        },
    )
    try:
        yield node.start()
    finally:
        finish([node], node.name)


# -- the settings ----------------------------------------------------------------------


BOUNDS = {
    # option: (default, how docs/api.md writes it, a value out of range)
    "claim_answer_bytes": (16 << 20, "16 MiB", "1000"),
    "max_poll_waiters": (512, "512", "0"),
    "max_connections": (1024, "1,024", "0"),
    "keepalive_s": (75.0, "75 s", "0"),
    "header_timeout_s": (10.0, "10 s", "301"),
}


@pytest.mark.parametrize("option", sorted(BOUNDS))
def test_each_bound_has_its_documented_default_and_a_checked_range(
    option: str, tmp_path: Path
) -> None:
    default, written, bad = BOUNDS[option]
    assert getattr(Config(), option) == default
    docs = DOCS.read_text(encoding="utf-8")
    row = next((line for line in docs.splitlines() if line.startswith(f"| `{option}`")), None)
    assert row is not None and written in row, f"{option} is not in docs/api.md's Bounds table"
    # the environment and the file set it; out of range is one line naming the range
    var = "QUEUE_NODE_" + option.upper()
    with pytest.raises(ConfigError, match=rf"{option} = .* is out of range: allowed .* to "):
        load_config({}, env={var: bad})
    config_file = tmp_path / "node.toml"
    config_file.write_text(f"{option} = {bad}\n")
    with pytest.raises(ConfigError, match=rf"{option} = .* is out of range") as caught:
        load_config({}, env={}, config_file=config_file)
    assert f"{config_file}:1" in str(caught.value)


# -- 1. a claim answer's bytes -------------------------------------------------------------


def test_a_claim_answer_stops_at_claim_answer_bytes_and_hands_the_rest_back(
    bounded: NodeProcess,
) -> None:
    now = time.time()
    keys = {f"big-{i:02d}" for i in range(40)}
    rows = [{"key": k, "route": "big", "due_at": now - 600, "payload": "x" * 6000} for k in keys]
    assert bounded.request("POST", "/rows", rows, headers=AUTH)[0] == 200

    def claim(accept: str) -> tuple[bytes, list[dict[str, Any]]]:
        conn = http.client.HTTPConnection(*_address(bounded), timeout=30)
        try:
            body = json.dumps({"max": 40, "consumer": "bounds", "lease_s": 120})
            conn.request("POST", "/claim", body, {**AUTH, "Accept": accept,
                                                  "Content-Type": "application/json"})  # fmt: skip
            resp = conn.getresponse()
            raw = resp.read()
            assert resp.status == 200, raw[:300]
        finally:
            conn.close()
        doc = msgpack.unpackb(raw) if "msgpack" in accept else json.loads(raw)
        return raw, doc["leases"]

    first = wait_for(lambda: (got := claim("application/json"))[1] and got, 30, "a first claim")
    raw, leases = first
    # The answer is within the bound, and not everything due fit in it.
    assert len(raw) <= CLAIM_ANSWER_BYTES, len(raw)
    assert 1 <= len(leases) < 40, len(leases)
    sent = {lease["key"] for lease in leases}
    # What was not sent is not left leased, and not held either.
    status, live = bounded.request("GET", "/leases?limit=1000", headers=AUTH)
    assert status == 200
    assert {lease["key"] for lease in live["leases"]} & keys == sent
    status, held = bounded.request("GET", "/held?limit=1000", headers=AUTH)
    assert status == 200 and not {h["key"] for h in held["held"]} & keys, held

    # The rest comes with the next claims (JSON and msgpack alike), each
    # answer within the bound, no key twice.
    claimed = [lease["key"] for lease in leases]
    accepts = itertools.cycle(["application/msgpack", "application/json"])

    def more() -> bool:
        raw, leases = claim(next(accepts))
        assert len(raw) <= CLAIM_ANSWER_BYTES, len(raw)
        claimed.extend(lease["key"] for lease in leases)
        return set(claimed) == keys

    wait_for(more, 60, "every row claimed")
    assert sorted(claimed) == sorted(keys), "a key was granted twice"

    # The ledger balances: every grant handed back counts as released.
    def balanced() -> dict[str, Any] | bool:
        status, doc = bounded.request("GET", "/accounting", headers=AUTH)
        return status == 200 and doc["balanced"] and doc

    accounting = wait_for(balanced, 30, "the ledger balanced")
    assert accounting["in_flight"] == 40
    assert accounting["routed"] - accounting["released"] == 40
    assert accounting["released"] > 0


# -- 2. long-poll waiters ----------------------------------------------------------------


def _poll(node: NodeProcess, job: str, wait_s: float) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection(*_address(node), timeout=wait_s + 30)
    try:
        conn.request("GET", f"/jobs/{job}/results?wait_s={wait_s}", headers=AUTH)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read())
    finally:
        conn.close()


def test_long_polls_past_max_poll_waiters_are_429(bounded: NodeProcess) -> None:
    answers: list[int] = []

    def wait() -> None:
        # A probe below may hold a place for its 0.05 s: then try again.
        while (status := _poll(bounded, "w", 6)[0]) == 429:
            pass
        answers.append(status)

    waiters = [threading.Thread(target=wait) for _ in range(MAX_POLL_WAITERS)]
    for thread in waiters:
        thread.start()
    try:
        refused = wait_for(
            lambda: (got := _poll(bounded, "other", 0.05))[0] == 429 and got,
            5,
            f"a long poll refused while {MAX_POLL_WAITERS} wait",
        )
        status, headers, doc = refused
        assert doc["error"]["code"] == "too_many_waiters" and doc["error"]["field"] == "wait_s"
        assert headers["Retry-After"] == "1"
        # A poll that does not wait is never refused for it.
        assert _poll(bounded, "other", 0)[0] == 200
    finally:
        for thread in waiters:
            thread.join(30)
    assert answers == [200] * MAX_POLL_WAITERS
    assert _poll(bounded, "w", 0.05)[0] == 200  # their places are free again


def test_the_ledger_forgets_a_job_name_when_its_last_waiter_leaves(bounded: NodeProcess) -> None:
    """Every distinct job name a long poll waited on left an entry in the
    ledger's table of waiters, for good: a caller polling made-up names grew
    it without end. Now an entry lives while a poll waits on it."""
    from node.ipc import IpcClient
    from workers.claim import ledger_address

    address = ledger_address(bounded.name)

    def poll(job: str, wait_s: float) -> None:
        client = IpcClient(address, timeout_s=30)
        try:
            assert client.call("poll", job=job, max=1, wait_s=wait_s)["results"] == []
        finally:
            client.close()

    ledger = IpcClient(address, timeout_s=30)
    try:
        polls = [threading.Thread(target=poll, args=(f"made-up-{i}", 1.5)) for i in range(20)]
        for thread in polls:
            thread.start()
        wait_for(lambda: ledger.call("stats")["poll_waiter_jobs"] == 20, 10, "20 names waited on")
        for thread in polls:
            thread.join(30)
        stats = ledger.call("stats")
        assert (stats["poll_waiters"], stats["poll_waiter_jobs"]) == (0, 0), stats
    finally:
        ledger.close()


# -- 3. connections ------------------------------------------------------------------------


def test_connections_past_max_connections_are_answered_503_and_closed(
    bounded: NodeProcess,
) -> None:
    held = [_connect(bounded) for _ in range(MAX_CONNECTIONS)]
    try:
        # Each held connection is served (so the worker has it), and stays open.
        for sock in held:
            sock.sendall(_get("/healthz"))
            assert _read_answer(sock, 10)[0] == 200
        with _connect(bounded) as extra:
            extra.sendall(_get("/healthz"))
            status, headers, body = _read_answer(extra, 5)
            assert status == 503 and _error_code(body) == "too_many_connections"
            assert headers["Retry-After"] == "1" and headers["Connection"] == "close"
            assert _closed_within(extra, 5)
        # One closed, one more is served.
        held.pop().close()

        def served() -> bool:
            with _connect(bounded) as sock:
                sock.sendall(_get("/healthz"))
                return _read_answer(sock, 10)[0] == 200

        wait_for(served, 10, "a connection served once one was closed")
    finally:
        for sock in held:
            sock.close()


# -- 4. idle keep-alive ----------------------------------------------------------------------


def test_an_idle_keepalive_connection_is_closed_after_keepalive_s(quick: NodeProcess) -> None:
    with _connect(quick) as sock:
        sock.sendall(_get("/healthz"))
        assert _read_answer(sock, 10)[0] == 200
        answered = time.monotonic()
        assert _closed_within(sock, KEEPALIVE_S + 5), "the idle connection was kept"
        assert time.monotonic() - answered >= KEEPALIVE_S - 0.5


# -- 5. the time to read a request's headers ------------------------------------------------


def _trickle(sock: socket.socket, request: bytes, deadline_s: float) -> bytes:
    """Send ``request`` a byte at a time, 0.1 s apart, until the node answers
    or closes; what it sent back (b"" when it closed without a word).
    Raises AssertionError if the node still reads after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    for byte in request:
        if time.monotonic() > end:
            break
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return b""
        sock.settimeout(0.1)
        try:
            got = sock.recv(65536)
        except TimeoutError:
            continue  # nothing yet: the next byte
        except ConnectionResetError:
            return b""
        return got + (b"" if not got else _rest(sock))
    raise AssertionError(f"the node still read the headers after {deadline_s} s")


def _rest(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


# Headers that would take over 10 s at 0.1 s a byte.
SLOW_HEADERS = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"


def test_headers_trickled_past_header_timeout_s_are_cut_with_408(quick: NodeProcess) -> None:
    with _connect(quick) as sock:
        started = time.monotonic()
        answer = _trickle(sock, SLOW_HEADERS, HEADER_TIMEOUT_S + 5)
        took = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert _error_code(answer.partition(b"\r\n\r\n")[2]) == "header_timeout"
    assert HEADER_TIMEOUT_S - 0.3 <= took < HEADER_TIMEOUT_S + 2, took


def test_the_header_clock_restarts_for_each_request_and_spares_one_in_progress(
    quick: NodeProcess,
) -> None:
    """A first request does not buy the connection time: the next request's
    headers get header_timeout_s from their first byte. And the clock does
    not run while a request is handled: a long poll outlasting it is
    answered, not cut."""
    wait_s = HEADER_TIMEOUT_S + 1.5
    with _connect(quick) as sock:
        sock.sendall(_get(f"/jobs/nothing/results?wait_s={wait_s}"))
        status, _, body = _read_answer(sock, wait_s + 10)
        assert (status, json.loads(body)) == (200, {"results": []})
        answer = _trickle(sock, SLOW_HEADERS, HEADER_TIMEOUT_S + 5)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]


# -- 6. the token guards every route but the open ones ---------------------------------------


def _route_table() -> list[tuple[str, str]]:
    """(method, path) of every route a worker serves, as workers.http.__main__
    builds the app."""
    from node.store import open_store
    from workers.http.app import WorkerContext, make_app
    from workers.http.console import routes as console_routes
    from workers.http.metrics import routes as metrics_routes
    from workers.http.results import routes as results_routes
    from workers.http.state import routes as state_routes
    from workers.http.work import routes as work_routes

    ctx = WorkerContext(
        config=Config(name="t", workers=1, token=TOKEN),
        store=open_store("memory://"),
        name="t",
        started_at=0.0,
    )
    app = make_app(
        ctx, [*work_routes, *results_routes, *state_routes, *metrics_routes, *console_routes]
    )
    return sorted(
        {
            (r.method, r.resource.canonical)
            for r in app.router.routes()
            if r.resource is not None and r.method != "HEAD"
        }
    )


OPEN = {
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/"),
    ("GET", "/console/{name}"),
}


def _status(
    node: NodeProcess, method: str, path: str, headers: dict[str, str]
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*_address(node), timeout=30)
    try:
        body = "{}" if method == "POST" else None
        conn.request(method, path, body, {"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_every_route_but_the_open_ones_needs_the_token(bounded: NodeProcess) -> None:
    table = _route_table()
    assert OPEN <= set(table)
    guarded = [route for route in table if route not in OPEN]
    assert len(guarded) >= 18, guarded
    for method, path in guarded:
        filled = path.replace("{job}", "j")
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, body = _status(bounded, method, filled, headers)
            assert status == 401 and _error_code(body) == "unauthorized", (method, path, body)
        if method == "GET":  # a read with the token is served (a POST would change things)
            assert _status(bounded, method, filled, AUTH)[0] != 401, (method, path)
    for method, path in sorted(OPEN):
        for verb in (method, "HEAD"):
            status, _ = _status(bounded, verb, path.replace("{name}", "console.js"), {})
            assert status == 200, (verb, path)
    # the document agrees: exactly the guarded operations ask for the token
    status, spec = bounded.request("GET", "/openapi.json", headers=AUTH)
    assert status == 200
    asks = {
        (m.upper(), p)
        for p, ops in spec["paths"].items()
        for m, op in ops.items()
        if {"bearer": []} in op["security"]
    }
    assert asks == set(guarded)
    from workers.http.errors import OPEN_ROUTES

    assert OPEN_ROUTES == OPEN  # CONTRACT.md, "Access": these and no more


# -- 7. --http unix:PATH --------------------------------------------------------------------


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 10.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


def _unix_request(path: str, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    conn = _UnixHTTPConnection(path)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, url, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "node", "run", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory of our own for socket files (sun_path is 107 bytes)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="qn-", dir="/tmp"))
    try:
        yield path
    finally:
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


def test_http_unix_serves_on_an_owner_only_socket_file(tmp_path: Path, sock_dir: Path) -> None:
    path = sock_dir / "node.sock"
    # A socket file left by a crashed node: nothing accepts on it.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    node = _node(tmp_path, "--http", f"unix:{path}")
    try:
        node.start(wait_ready=False)
        assert node.node_json()["http"] == f"unix:{path}"
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        wait_for(lambda: _unix_request(str(path), "GET", "/readyz")[0] == 200, 30, "ready")
        status, doc = _unix_request(str(path), "POST", "/rows", [{"key": "u", "route": "r"}])
        assert (status, doc) == (200, {"upserted": 1})
        assert _unix_request(str(path), "GET", "/rows?key=u")[0] == 200
        # a second node on the same socket is refused: it is in use
        second = _run_cli("--data-dir", str(tmp_path / "second"), "--name", node.name + "-2",
                          "--http", f"unix:{path}")  # fmt: skip
        assert second.returncode == 2 and "another process serves" in second.stderr, second
        assert node.stop() == 0
    finally:
        finish([node], node.name)


def test_http_unix_refuses_a_path_that_is_not_a_socket(tmp_path: Path, sock_dir: Path) -> None:
    path = sock_dir / "node.sock"
    path.write_text("not a socket\n")
    out = _run_cli("--data-dir", str(tmp_path / "data"), "--name", f"t-{uuid.uuid4().hex[:12]}",
                   "--http", f"unix:{path}")  # fmt: skip
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a socket" in lines[0], out.stderr
    assert path.read_text() == "not a socket\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_http_unix_refuses_a_directory_of_another_user(tmp_path: Path, sock_dir: Path) -> None:
    os.chown(sock_dir, 65534, 65534)
    out = _run_cli("--data-dir", str(tmp_path / "data"), "--name", f"t-{uuid.uuid4().hex[:12]}",
                   "--http", f"unix:{sock_dir}/n.sock")  # fmt: skip
    assert out.returncode == 2, out
    assert "not owned by this user" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_worker_raises_its_open_files_limit_to_what_max_connections_needs() -> None:
    """The common soft limit (1,024) equals the default bound: accept() hit
    EMFILE before the bound's 503 could answer. A worker raises its soft
    limit up to the hard one at start."""
    code = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "from workers.http.__main__ import FD_MARGIN, _raise_fd_limit\n"
        "_raise_fd_limit(1024)\n"
        "now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "want = 1024 + FD_MARGIN\n"
        "print('ok' if now == (want if hard == resource.RLIM_INFINITY else min(want, hard))"
        " else f'soft {now}')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.stdout.strip() == "ok", (done.stdout, done.stderr)
