"""Who may do what: one test per promise of docs/reliability.md, "Who may do what".

1. The node binds 127.0.0.1 by default; another address needs a token (file
   or environment).
2. With a token, every request but ``GET /healthz``, ``/readyz``,
   ``/metrics`` and the console's files needs ``Authorization: Bearer
   <token>``, compared in constant time; anything else is 401 and changes
   nothing.
3. ``--tls-cert`` / ``--tls-key`` serve HTTPS; bad files are exit 2, one line.
4. Segments, queues and data files are owner-only, whatever the umask; the
   ledger's abstract socket refuses peers of another uid.
5. Nothing is unpickled anywhere in the node's packages.
6. The handler comes only from the configuration, never from a request.
7. Request sizes, batch sizes and long-poll waits are bounded.

Most of these run against a real ``python -m node`` (node/testing.py).
"""

from __future__ import annotations

import ast
import asyncio
import grp
import hmac
import http.client
import json
import os
import shutil
import ssl
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node.config import load_config
from node.core.errors import ConfigError
from node.testing import ROOT, NodeProcess, cleanup_segments, finish, wait_for

pytestmark = pytest.mark.timeout(180)

TOKEN = "s3cret-token"
GOOD = {"Authorization": f"Bearer {TOKEN}"}
# Every way of not having the token (the non-ASCII one is sent as raw bytes).
BAD_AUTHORIZATIONS: list[dict[str, Any]] = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {TOKEN}x"},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": TOKEN},
    {"Authorization": "Bearer"},
    {"Authorization": b"Bearer s3cr\xc3\xa9t-token"},
    {"Authorization": b"Bearer \xff\xfe"},
]
MAX_BODY_BYTES = 16 << 20
PACKAGES = ("node", "keeper", "shm", "workers")


# -- helpers ----------------------------------------------------------------------------


def call(
    base: str,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, Any] | None = None,
    raw: bytes | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], Any]:
    """One request with exactly these headers (bytes values go out as they
    are): (status, headers, JSON answer or text)."""
    scheme, _, hostport = base.partition("://")
    host, port = hostport.rsplit(":", 1)
    if scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, int(port), timeout=30, context=context
        )
    else:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    try:
        conn.putrequest(method, path)
        if data is not None:
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        conn.endheaders(data)
        resp = conn.getresponse()
        text = resp.read()
        try:
            doc = json.loads(text) if text else None
        except ValueError:
            doc = text.decode(errors="replace")
        return resp.status, dict(resp.getheaders()), doc
    finally:
        conn.close()


def assert_error(answer: tuple[int, dict[str, str], Any], status: int, code: str) -> None:
    got_status, _headers, doc = answer
    assert got_status == status, answer
    assert isinstance(doc, dict) and set(doc) == {"error"}, answer
    assert set(doc["error"]) == {"code", "message", "field"}, answer
    assert doc["error"]["code"] == code, answer


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node", "run", *args],
        cwd=ROOT,
        env=dict(os.environ, **(env or {})),
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_one_line_exit_2(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for word in words:
        assert word in lines[0], out.stderr


def started(node: NodeProcess, **kw: Any) -> NodeProcess:
    # The node's log lives beside the data directory, not in it: the mode
    # checks below look at every file the node made there.
    node.log_path = node.data_dir.parent / f"{node.name}.log"
    return node.start(**kw)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[NodeProcess]]:
    """Nodes a test starts; killed and cleaned up whatever happens."""
    made: list[NodeProcess] = []
    yield made
    for node in made:
        finish([node], node.name)


def new_node(nodes: list[NodeProcess], data_dir: Path, *args: str, **kw: Any) -> NodeProcess:
    node = NodeProcess(data_dir, f"t-{uuid.uuid4().hex[:12]}", *args, **kw)
    nodes.append(node)
    return node


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One node with a token, shared by the token and bounds tests."""
    node = NodeProcess(
        tmp_path_factory.mktemp("secured") / "data", f"t-{uuid.uuid4().hex[:12]}", "--token", TOKEN
    )
    try:
        yield started(node)
    finally:
        finish([node], node.name)


def make_cert(where: Path, name: str = "server") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made with the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    cert, key = where / f"{name}.crt", where / f"{name}.key"
    made = subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    return cert, key


# -- 1. where the node listens -----------------------------------------------------------


def test_the_node_binds_loopback_by_default() -> None:
    from node.cli import build_parser

    assert load_config({}, env={}).http == "127.0.0.1:8470"
    # the command line has no default of its own that could widen it
    assert build_parser().parse_args(["run"]).http is None


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0", "192.0.2.7:8470", "example.com:80"])
def test_another_address_without_a_token_is_refused(tmp_path: Path, address: str) -> None:
    out = run_cli("--data-dir", str(tmp_path / "data"), "--http", address, env={
        "QUEUE_NODE_TOKEN": ""})  # fmt: skip
    assert_one_line_exit_2(out, "token")
    assert not (tmp_path / "data").exists()  # refused before anything was made


@pytest.mark.parametrize("bad", ["", "two words", "tab\there", "s3crét", "x" * 4097])
def test_a_token_that_cannot_travel_in_a_header_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="token is not valid"):
        load_config({"token": bad, "http": "0.0.0.0:0"}, env={})


@pytest.mark.parametrize("source", ["file", "environment"])
def test_another_address_with_a_token_starts(
    tmp_path: Path, nodes: list[NodeProcess], source: str
) -> None:
    env: dict[str, str] = {}
    args = ["--http", "0.0.0.0:0"]
    if source == "file":
        config = tmp_path / "node.toml"
        config.write_text(f'token = "{TOKEN}"\n')
        args += ["--config", str(config)]
    else:
        env["QUEUE_NODE_TOKEN"] = TOKEN
    node = started(new_node(nodes, tmp_path / "data", *args, env=env))
    host, port = node.node_json()["http"].rsplit(":", 1)
    assert host == "0.0.0.0"
    base = f"http://127.0.0.1:{port}"
    rows = [{"key": "a", "route": "r"}]
    assert_error(call(base, "POST", "/rows", rows), 401, "unauthorized")
    assert call(base, "POST", "/rows", rows, GOOD)[0::2] == (200, {"upserted": 1})
    assert node.stop() == 0


# -- 2. the token guards every route but health, readiness, metrics, the console ---------

OPEN = {("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics"), ("GET", "/"),
        ("GET", "/console/{name}")}  # fmt: skip


def _fill(path: str) -> str:
    return path.replace("{job}", "j").replace("{name}", "x")


def test_every_route_of_a_real_node_but_the_open_ones_needs_the_token(
    secured: NodeProcess,
) -> None:
    base = secured.base_url
    status, _, spec = call(base, "GET", "/openapi.json", headers=GOOD)
    assert status == 200
    operations = sorted(
        (method.upper(), path) for path, ops in spec["paths"].items() for method in ops
    )
    guarded = [op for op in operations if op not in OPEN]
    assert OPEN <= set(operations)
    posts = [p for m, p in guarded if m == "POST"]
    assert {"/rows", "/rows/delete", "/claim", "/complete", "/jobs/{job}/ack"} <= set(posts)
    reads = {p for m, p in guarded if m == "GET"}
    assert {"/results", "/jobs/{job}/results", "/rows", "/leases", "/held", "/queue-state",
            "/accounting", "/openapi.json"} <= reads  # fmt: skip
    # The description agrees: every guarded operation says so, and no other.
    described = sorted(
        (method.upper(), path)
        for path, ops in spec["paths"].items()
        for method, op in ops.items()
        if {"bearer": []} in op.get("security", [])
    )
    assert described == guarded

    # Something for an unauthorised request to change, or to show, if it could.
    seeded = [{"key": "seeded", "route": "r", "payload": {"secret": "payload"}}]
    assert call(base, "POST", "/rows", seeded, GOOD)[0] == 200
    bodies = {
        "/rows": [{"key": "intruder", "route": "r"}],
        "/rows/delete": {"keys": ["seeded"]},
        "/claim": {"max": 10, "consumer": "intruder"},
        "/admin/pause": {},
        "/admin/unhold": {"keys": ["seeded"]},
        "/admin/run-now": {"route": "r"},
        "/jobs/{job}/ack": {"ids": [1]},
    }
    for method, path in guarded:
        target = _fill(path) + ("?key=seeded" if path == "/rows" and method == "GET" else "")
        for headers in BAD_AUTHORIZATIONS:
            body = bodies.get(path, {}) if method == "POST" else None
            answer = call(base, method, target, body, headers)
            assert_error(answer, 401, "unauthorized")
            assert answer[1]["WWW-Authenticate"] == "Bearer", (path, headers)
            assert "payload" not in json.dumps(answer[2]) and "seeded" not in json.dumps(answer[2])
    # An unknown path is 401 too, GET or POST: no probing of paths without the token.
    assert_error(call(base, "POST", "/no-such-path", {}), 401, "unauthorized")
    assert_error(call(base, "GET", "/no-such-path"), 401, "unauthorized")
    # The open ones answer without it.
    for method, path in sorted(OPEN):
        status = call(base, method, path.replace("{name}", "console.js"))[0]
        assert status == 200, path

    # Nothing changed: no row written or deleted, nothing leased, not paused.
    assert call(base, "GET", "/rows?key=intruder", headers=GOOD)[0] == 404
    assert call(base, "GET", "/rows?key=seeded", headers=GOOD)[0] == 200
    assert call(base, "GET", "/accounting", headers=GOOD)[2]["routed"] == 0

    def claimed() -> list[str]:
        status, _, doc = call(base, "POST", "/claim", {"max": 10, "consumer": "owner"}, GOOD)
        return [lease["key"] for lease in doc["leases"]] if status == 200 else []

    assert wait_for(claimed, 30, "the seeded row to be claimable") == ["seeded"]

    # The token is never shown: not by any route, not in the log.
    for path in ("/healthz", "/readyz", "/openapi.json", "/queue-state", "/accounting",
                 "/metrics", "/", "/leases", "/held", "/rows?key=seeded"):  # fmt: skip
        for headers in ({}, GOOD):
            status, _, doc = call(base, "GET", path, headers=headers)
            assert status < 500 and TOKEN not in json.dumps(doc), path
    assert TOKEN not in Path(secured.log_path).read_text()


def test_every_route_in_the_route_table_but_the_open_ones_needs_the_token() -> None:
    """The app as a worker builds it (workers.http.__main__.serve), walked route by
    route: a route added anywhere is guarded unless it is one of the open
    ones (CONTRACT.md, "Access"), whatever its method."""
    from aiohttp.test_utils import TestClient, TestServer

    from node.config import Config
    from node.store import open_store
    from workers.http.app import WorkerContext, make_app
    from workers.http.console import routes as console_routes
    from workers.http.errors import OPEN_ROUTES
    from workers.http.metrics import routes as metrics_routes
    from workers.http.results import routes as results_routes
    from workers.http.state import routes as state_routes
    from workers.http.work import routes as work_routes

    assert OPEN_ROUTES == OPEN
    ctx = WorkerContext(
        config=Config(name="t", workers=1, token=TOKEN),
        store=open_store("memory://"),
        name="t",
        started_at=0.0,
    )
    app = make_app(
        ctx, [*work_routes, *results_routes, *state_routes, *metrics_routes, *console_routes]
    )
    table = sorted(
        {
            (r.method, r.resource.canonical)
            for r in app.router.routes()
            if r.resource is not None and r.method != "*"
        }
    )
    guarded = [(m, p) for m, p in table if ("GET" if m == "HEAD" else m, p) not in OPEN]
    assert len(guarded) >= 25, guarded

    async def walk() -> list[tuple[str, str, int, str | None]]:
        out = []
        async with TestClient(TestServer(app)) as client:
            for method, path in guarded:
                resp = await client.request(method, _fill(path), json={})
                doc = None if method == "HEAD" else (await resp.json())["error"]["code"]
                out.append((method, path, resp.status, doc))
        return out

    answers = asyncio.run(walk())
    expected = [(m, p, 401, None if m == "HEAD" else "unauthorized") for m, p in guarded]
    assert answers == expected


def test_the_token_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every supplied token, of any length, reaches hmac.compare_digest (no
    early exit on a length or a prefix that a timer could see). No timing is
    measured: the function in the path is."""
    import workers.http.errors as http_errors

    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    supplied = [TOKEN, "", "s", TOKEN[:-1], TOKEN + "x", "x" * 5000, "s3cré"]
    for value in supplied:
        assert http_errors.token_matches(f"Bearer {value}", TOKEN) is (value == TOKEN)
    assert [a for a, _ in compared] == [v.encode() for v in supplied]
    assert {b for _, b in compared} == {TOKEN.encode()}


# -- 3. TLS ------------------------------------------------------------------------------


def test_tls_serves_https_and_plain_http_fails(tmp_path: Path, nodes: list[NodeProcess]) -> None:
    cert, key = make_cert(tmp_path)
    node = started(
        new_node(nodes, tmp_path / "data", "--tls-cert", str(cert), "--tls-key", str(key)),
        wait_ready=False,
    )
    port = node.node_json()["http"].rsplit(":", 1)[1]
    https = f"https://127.0.0.1:{port}"
    trusted = ssl.create_default_context(cafile=str(cert))  # verifies the name too

    def up() -> bool:
        try:
            return call(https, "GET", "/healthz", context=trusted)[0] == 200
        except OSError:
            return False

    wait_for(up, 30, "HTTPS /healthz")
    rows = [{"key": "a", "route": "r"}]
    assert call(https, "POST", "/rows", rows, context=trusted)[0::2] == (200, {"upserted": 1})
    with pytest.raises((http.client.HTTPException, OSError)):
        call(f"http://127.0.0.1:{port}", "GET", "/healthz")
    # A client that does not trust the certificate does not get through either.
    with pytest.raises(ssl.SSLCertVerificationError):
        call(https, "GET", "/healthz", context=ssl.create_default_context())
    assert node.stop() == 0
    assert "action=worker_failed" not in Path(node.log_path).read_text()


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing cert", ["--tls-cert", "No such file"]),
        ("missing key", ["--tls-key", "No such file"]),
        ("junk cert", ["not a PEM certificate"]),
        ("key of another cert", ["does not belong"]),
        ("cert without key", ["--tls-cert and --tls-key go together"]),
    ],
)
def test_bad_tls_files_are_exit_2_with_one_line(
    tmp_path: Path, case: str, words: list[str]
) -> None:
    cert, key = make_cert(tmp_path)
    _, other_key = make_cert(tmp_path, "other")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    args = {
        "missing cert": ["--tls-cert", str(tmp_path / "nope.crt"), "--tls-key", str(key)],
        "missing key": ["--tls-cert", str(cert), "--tls-key", str(tmp_path / "nope.key")],
        "junk cert": ["--tls-cert", str(junk), "--tls-key", str(key)],
        "key of another cert": ["--tls-cert", str(cert), "--tls-key", str(other_key)],
        "cert without key": ["--tls-cert", str(cert)],
    }[case]
    name = f"t-{uuid.uuid4().hex[:12]}"
    out = run_cli("--data-dir", str(tmp_path / "data"), "--name", name, "--http", "127.0.0.1:0",
                  "--workers", "1", *args)  # fmt: skip
    try:
        assert_one_line_exit_2(out, *words)
    finally:
        cleanup_segments(name)
    assert not Path(f"/dev/shm/queue-node.{name}.ready").exists()


# -- 4. owner-only files, segments and queues --------------------------------------------


def _node_shm(name: str) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"*queue-node.{name}.*"))


def _mqueues(name: str) -> list[Path]:
    root = Path("/dev/mqueue")
    return sorted(root.glob(f"queue-node.{name}.*")) if root.is_dir() else []


def _modes(paths: list[Path]) -> dict[str, int]:
    return {str(p): stat.S_IMODE(p.lstat().st_mode) for p in paths}


def _open_to_others(root: Path) -> dict[str, str]:
    """Every path under ``root`` with a group or other permission bit."""
    return {
        str(p.relative_to(root)): oct(mode)
        for p in root.rglob("*")
        if (mode := stat.S_IMODE(p.lstat().st_mode)) & 0o077
    }


@pytest.mark.timeout(240)
def test_everything_the_node_makes_is_owner_only_under_umask_000(
    tmp_path: Path, nodes: list[NodeProcess]
) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    env = {"QUEUE_NODE_STATE_GROUP": group, "QUEUE_NODE_CPU_WORK_ROUNDS": "1"}
    node = new_node(
        nodes, tmp_path / "data", "--handler", "node.handlers:cpu_work", "--inference-procs", "1",
        env=env,
    )  # fmt: skip
    node.data_dir.mkdir(parents=True)
    old = os.umask(0)
    try:
        started(node)
    finally:
        os.umask(old)
    rows = [{"key": f"k{i}", "route": "r", "job": "j"} for i in range(20)]
    assert node.request("POST", "/rows", rows)[0] == 200

    def finished() -> bool:
        status, accounts = node.request("GET", "/accounting")
        return status == 200 and accounts["finished"] >= 20  # 503 while the ledger starts

    wait_for(finished, 60, "every row finished: log segments written")
    status, doc = node.request("GET", "/jobs/j/results?max=5")
    assert status == 200 and doc["results"]

    data = node.data_dir
    assert _open_to_others(data) == {}
    modes = _modes([data / "schedule.db", data / "schedule.db-wal", data / "schedule.db-shm",
                    data / "node.json", data / "run" / "config.json"])  # fmt: skip
    assert set(modes.values()) == {0o600}, modes
    assert stat.S_IMODE((data / "metrics").stat().st_mode) == 0o700
    assert stat.S_IMODE((data / "log").stat().st_mode) == 0o700
    assert list((data / "metrics").iterdir()), "metrics files of every process"
    assert list((data / "log").iterdir()), "completion log segments"

    segments = _modes(_node_shm(node.name))
    state = f"/dev/shm/queue-node.{node.name}.state"
    assert segments.pop(state) == 0o640, "the state buffer, for its group"
    assert Path(state).stat().st_gid == os.getgid()
    kinds = {Path(p).name.rsplit(".", 1)[1] for p in segments}
    assert kinds == {"ready", "leases", "wake", "classes"}
    assert set(segments.values()) == {0o600}, segments
    queues = _modes(_mqueues(node.name))
    assert set(queues.values()) <= {0o600}, queues

    assert node.stop() == 0
    assert stat.S_IMODE((data / "leases.msgpack").stat().st_mode) == 0o600
    assert _open_to_others(data) == {}
    assert _node_shm(node.name) == []


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another uid")
def test_the_ledger_socket_refuses_a_peer_of_another_uid(secured: NodeProcess) -> None:
    """The ledger's socket is abstract (``\\0queue-node.<name>.ledger``): it has
    no file and no mode, so anyone on the host can connect. The guard is
    SO_PEERCRED: the ledger closes any connection whose peer uid is not its
    own, before reading a byte."""
    from node.ipc import IpcClient, pack
    from workers.claim import ledger_address

    frame = pack({"op": "stats", "id": 1})
    code = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.connect({ledger_address(secured.name)!r})\n"
        "s.settimeout(10)\n"
        f"try:\n    s.sendall({frame!r})\n    got = s.recv(1)\n"
        "except ConnectionError:\n    got = b''\n"
        "sys.exit(0 if got == b'' else 1)\n"
    )
    refused = subprocess.run([sys.executable, "-c", code], timeout=30, capture_output=True)
    assert refused.returncode == 0, refused.stderr
    assert "ipc_peer_refused" in Path(secured.log_path).read_text()
    # our own uid is served
    client = IpcClient(ledger_address(secured.name), timeout_s=10)
    try:
        assert "log" in client.call("stats")
    finally:
        client.close()


# -- 5. nothing is unpickled ---------------------------------------------------------------

# Modules that turn bytes into arbitrary objects, or whose pipes and queues
# do (multiprocessing pickles everything it sends between processes).
UNSAFE_MODULES = (
    "pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal", "shelve",
    "copyreg", "multiprocessing", "concurrent.futures.process",
)  # fmt: skip
# Names that load pickles or run text as code, wherever they come from.
UNSAFE_NAMES = ("ProcessPoolExecutor", "read_pickle")
UNSAFE_BUILTINS = ("eval", "exec", "__import__")


def _unsafe_name(node: ast.AST) -> str | None:
    """The unsafe thing ``node`` names, if any."""
    if isinstance(node, ast.Name) and node.id in UNSAFE_NAMES + UNSAFE_BUILTINS:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in UNSAFE_NAMES:
        return node.attr
    if isinstance(node, ast.alias) and node.name.rsplit(".", 1)[-1] in UNSAFE_NAMES:
        return node.name
    if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
        if not (isinstance(node.value, ast.Constant) and node.value.value is False):
            return "allow_pickle"
    if (  # torch.load unpickles unless weights_only; the node has no business with it
        isinstance(node, ast.Attribute)
        and node.attr == "load"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    ):
        return "torch.load"
    return None


def unsafe_uses(source: str, filename: str = "<source>") -> list[str]:
    """Every import of an unsafe module and every use of an unsafe name."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for module in modules:
            if any(module == m or module.startswith(m + ".") for m in UNSAFE_MODULES):
                found.append(f"{filename}:{node.lineno}: import {module}")
        name = _unsafe_name(node)
        if name is not None:
            found.append(f"{filename}:{getattr(node, 'lineno', '?')}: {name}")
    return found


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import _pickle as p",
        "from pickle import loads",
        "from multiprocessing import Queue",
        "import multiprocessing.connection",
        "from concurrent.futures import ProcessPoolExecutor",
        "import marshal",
        "import shelve",
        "numpy.load(f, allow_pickle=True)",
        "eval(text)",
        "__import__('pickle')",
        "torch.load(path)",
        "from pandas import read_pickle",
    ],
)
def test_the_unpickling_scan_finds_what_it_looks_for(snippet: str) -> None:
    assert unsafe_uses(snippet)


def test_the_unpickling_scan_leaves_lookalikes_alone() -> None:
    assert unsafe_uses("model.eval()\nnp.load(f, allow_pickle=False)\njson.loads(text)") == []


def test_nothing_in_the_node_is_unpickled() -> None:
    """No module of the node's packages imports pickle, marshal, shelve or
    multiprocessing (whose Queues and Pipes unpickle what they receive).
    Every byte the node reads from a file, a segment or a socket is msgpack,
    JSON or a fixed struct layout."""
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert len(files) > 30
    found = [hit for path in files for hit in unsafe_uses(path.read_text(), str(path))]
    assert found == []


# -- 6. the handler comes from the configuration only -------------------------------------


@pytest.mark.timeout(240)
def test_a_request_never_names_the_handler(tmp_path: Path, nodes: list[NodeProcess]) -> None:
    """A handler is code the node imports. A request that names one is
    refused (unknown field) or, where the name is only data (a route, a job,
    a payload), runs the configured handler; the named module is never
    imported."""
    modules = tmp_path / "modules"
    modules.mkdir()
    marker = tmp_path / "imported"
    (modules / "qn_marker.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\n"
        "def boom(items):\n    return ['boom' for _ in items]\n"
    )
    spec = "qn_marker:boom"
    env = {
        "PYTHONPATH": os.pathsep.join([str(modules), os.environ.get("PYTHONPATH", "")]),
        "QUEUE_NODE_CPU_WORK_ROUNDS": "1",
    }
    node = started(new_node(nodes, tmp_path / "data", "--handler", "node.handlers:cpu_work",
                            "--inference-procs", "1", env=env))  # fmt: skip
    for path, body, field in [
        ("/rows", [{"key": "a", "route": "r", "handler": spec}], "handler"),
        ("/claim", {"max": 1, "consumer": "c", "handler": spec}, "handler"),
        ("/complete", {"lease_id": 1, "key": "a", "result": 1, "handler": spec}, "handler"),
        ("/release", {"lease_id": 1, "key": "a", "handler": spec}, "handler"),
        ("/admin/pause", {"handler": spec}, "handler"),
    ]:
        status, doc = node.request("POST", path, body)
        assert (status, doc["error"]["code"]) == (400, "unknown_field"), (path, doc)
        assert doc["error"]["field"].endswith(field), (path, doc)
    # Names of a handler where a request may carry text: only data.
    rows = [
        {"key": spec, "route": spec, "job": spec, "payload": {"handler": spec}},
        {"key": "b", "route": "os:system", "job": spec, "payload": "os:system"},
    ]
    assert node.request("POST", "/rows", rows) == (200, {"upserted": 2})

    def results() -> list[dict]:
        status, doc = node.request("GET", f"/jobs/{spec}/results?max=10")
        return doc["results"] if status == 200 and len(doc["results"]) == 2 else []

    from node.handlers import cpu_digest

    got = {r["key"]: r["result"] for r in wait_for(results, 60, "both results")}
    assert got == {
        row["key"]: {"digest": cpu_digest(row["key"], row["payload"], 1), "rounds": 1}
        for row in rows
    }
    assert node.stop() == 0
    assert not marker.exists(), "a module named by a request was imported"


# -- 7. bounds ------------------------------------------------------------------------------


def test_request_sizes_and_waits_are_bounded(secured: NodeProcess) -> None:
    base = secured.base_url
    over = b"[" + b" " * (MAX_BODY_BYTES - 1) + b"]"
    assert_error(call(base, "POST", "/rows", headers=GOOD, raw=over), 413, "body_too_large")
    exact = b"[" + b" " * (MAX_BODY_BYTES - 2) + b"]"
    assert call(base, "POST", "/rows", headers=GOOD, raw=exact)[0::2] == (200, {"upserted": 0})
    many = [{"key": f"many{i}", "route": "r"} for i in range(10_001)]
    assert_error(call(base, "POST", "/rows", many, GOOD), 400, "too_many_rows")
    assert call(base, "GET", "/rows?key=many0", headers=GOOD)[0] == 404
    for body, code in [
        ({"max": 0, "consumer": "c"}, "invalid_max"),
        ({"max": 10_001, "consumer": "c"}, "invalid_max"),
        ({"max": 1, "consumer": "c", "lease_s": 0}, "invalid_lease_s"),
        ({"max": 1, "consumer": "c", "lease_s": 86_401}, "invalid_lease_s"),
    ]:
        assert_error(call(base, "POST", "/claim", body, GOOD), 400, code)
    for query, code in [
        ("max=0", "invalid_max"),
        ("max=10001", "invalid_max"),
        ("wait_s=-1", "invalid_wait_s"),
        ("wait_s=61", "invalid_wait_s"),
        ("wait_s=inf", "invalid_wait_s"),
    ]:
        for path in ("/results", "/jobs/j/results"):
            assert_error(call(base, "GET", f"{path}?{query}", headers=GOOD), 400, code)
    status, _, doc = call(base, "GET", "/results?max=10000&wait_s=0", headers=GOOD)
    assert (status, doc) == (200, {"results": []})
    assert call(base, "GET", "/healthz")[0] == 200  # the worker is fine afterwards


@pytest.mark.parametrize("value, ok", [(0, False), (1, True), (10_000, True), (10_001, False)])
def test_the_inference_batch_size_is_bounded(value: int, ok: bool) -> None:
    if ok:
        assert load_config({}, env={"QUEUE_NODE_BATCH_SIZE": str(value)}).batch_size == value
    else:
        with pytest.raises(ConfigError, match="batch_size"):
            load_config({}, env={"QUEUE_NODE_BATCH_SIZE": str(value)})


def test_an_out_of_range_batch_size_is_exit_2(tmp_path: Path) -> None:
    out = run_cli("--data-dir", str(tmp_path), env={"QUEUE_NODE_BATCH_SIZE": "0"})
    assert_one_line_exit_2(out, "batch_size", "1 to 10000")
