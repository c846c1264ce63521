"""Acceptance: bad input through the whole stack changes nothing (issue 5, part 2).

tests/integration/test_http.py and test_claim.py check every validation rule on the
app in-process, with plain objects for the node. Here the same kinds of bad
input go to a real ``python -m node run`` (HTTP worker, lease table in shared
memory, ledger over its socket, SQLite), each case asserting:

- the status and the contract's ``{"error": {"code", "message", "field"}}``
  with the documented code (and field where one is at fault);
- that nothing changed: the schedule table (row count and the change log's
  last seq, which every write moves), the live leases, the held keys, and
  the ledger's accounting (every counter but ``received``, which the keeper
  moves as rows come due on its own).

At the end of the module the node is healthy, runs the processes it started
with (``node.json``'s pids: a bad request that crashed a worker shows as a
restarted pid), and its log has no traceback.

Also here, because tests/acceptance/test_node.py and tests/acceptance/test_import.py do not cover
them: a config file that is not UTF-8 or not TOML, and a gzip import file that
is cut short or corrupt.

Regression tests for what this file and tests/campaign/test_fuzz.py found:
``test_ack_of_an_id_past_64_bits_is_never_offered`` (was a 500: msgpack
cannot carry the id to the ledger), ``GET /rows?key=%FF`` in
``test_keys_that_are_not_valid_utf8`` (looked up U+FFFD instead of refusing),
``max=1_0`` and unknown query parameters in
``test_out_of_range_query_parameters`` (int() took the first, the others were
ignored), and
``test_broken_gzip_import_imports_nothing`` (was a traceback, exit 1).
"""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgpack
import pytest

from node.testing import ROOT, NodeProcess, wait_for
from workers.http.errors import ERROR_CODES

MIB = 1 << 20
MAX_CLASSES = 4
JSON = "application/json"
MSGPACK = "application/msgpack"
DUE_KEYS = [f"due-{i}" for i in range(6)]
LATER_KEYS = [f"later-{i}" for i in range(4)]


# -- the node and its state ------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    raw: bytes

    def json(self) -> Any:
        return json.loads(self.raw)


@dataclass
class World:
    """The node and what the setup left in it: live leases, a result offered
    and not acked."""

    node: NodeProcess
    leases: dict[str, int] = field(default_factory=dict)  # key -> lease_id
    offered_id: int = 0
    done_key: str = ""


def send(
    node: NodeProcess,
    method: str,
    path: str,
    body: bytes | None = None,
    content_type: str = JSON,
    headers: dict[str, str] | None = None,
    chunked: bool = False,
) -> Answer:
    host, port = node.info["http"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        all_headers = {"Content-Type": content_type, **(headers or {})}
        payload: Any = body
        if chunked and body is not None:
            payload = iter([body[i : i + MIB] for i in range(0, len(body), MIB)])
        conn.request(method, path, body=payload, headers=all_headers, encode_chunked=chunked)
        resp = conn.getresponse()
        return Answer(resp.status, dict(resp.getheaders()), resp.read())
    finally:
        conn.close()


def send_json(node: NodeProcess, method: str, path: str, obj: Any = None) -> Answer:
    return send(node, method, path, None if obj is None else json.dumps(obj).encode())


def assert_error(answer: Answer, status: int, code: str, field: str | None = "") -> dict:
    """The contract's error shape with this status and code; ``field`` too
    unless left as ""."""
    assert answer.status == status, (answer.status, answer.raw[:300])
    assert ERROR_CODES[code][0] == status
    doc = answer.json()
    assert set(doc) == {"error"}, doc
    error = doc["error"]
    assert set(error) == {"code", "message", "field"}, error
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"], error
    if field != "":
        assert error["field"] == field, error
    return error


def snapshot(world: World) -> dict[str, Any]:
    """What a bad request must not change."""
    node = world.node
    db = sqlite3.connect(f"file:{node.data_dir / 'schedule.db'}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT count(*) FROM schedule").fetchone()[0]
        seq = db.execute("SELECT max(seq) FROM changes").fetchone()[0]
        stored = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'changes'").fetchone()
    finally:
        db.close()
    # The keeper's document as of a moment its buckets had applied every
    # change committed (``gaps.input_bound``, the changes it had not, is 0):
    # a lease that ended while its write-back waited in the feed would show
    # as waiting for that moment (docs/accounting.md).
    accounting = wait_for(
        lambda: (a := send_json(node, "GET", "/accounting").json())["gaps"].get("input_bound")
        in (0, None) and a, 10, "a keeper document with every change applied")
    for volatile in ("received", "since", "balanced"):
        accounting.pop(volatile, None)
    # When the keeper last checked the input law: a time, not a count.
    accounting.get("gaps", {}).pop("input_as_of", None)
    leases = send_json(node, "GET", "/leases").json()["leases"]
    held = send_json(node, "GET", "/held").json()["held"]
    return {
        "rows": rows,
        "seq": max(seq or 0, stored[0] if stored else 0),
        "accounting": accounting,
        "leases": sorted((x["key"], x["lease_id"], x["expires_at"]) for x in leases),
        "held": sorted((x["key"], x["misses"], x["parked"]) for x in held),
    }


def unchanged(world: World, request: Callable[[], Answer]) -> Answer:
    before = snapshot(world)
    answer = request()
    assert snapshot(world) == before, answer.raw[:300]
    return answer


def _quiet(world: World) -> bool:
    """The node's writes have settled: two snapshots a little apart agree."""
    first = snapshot(world)
    time.sleep(0.2)  # polling interval of a deadline wait, not synchronisation
    return snapshot(world) == first


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import uuid

    data_dir = tmp_path_factory.mktemp("bad-input")
    env = {"QUEUE_NODE_MAX_CLASSES": str(MAX_CLASSES)}
    node = NodeProcess(data_dir, f"t-{uuid.uuid4().hex[:12]}", env=env).start()
    try:
        world = World(node)
        _set_up(world)
        pids = node.pids()
        yield world
        assert send_json(node, "GET", "/healthz").status == 200
        assert node.pids() == pids, "a process of the node was restarted"
        assert "Traceback" not in node.log(), node.log()
    finally:
        assert node.stop() == 0, node.log()


def _set_up(world: World) -> None:
    """Rows, a lease on every due key (so nothing more is granted or expires
    while the cases run), and one result offered but not acked."""
    node = world.node
    now = time.time()
    rows = [{"key": k, "route": "r", "due_at": now - 600} for k in DUE_KEYS]
    rows += [{"key": k, "route": "r", "due_at": now + 3600} for k in LATER_KEYS]
    assert send_json(node, "POST", "/rows", rows).json() == {"upserted": len(rows)}

    def claim_all() -> bool:
        claim = {"max": 100, "consumer": "owner", "lease_s": 600}
        answer = send_json(node, "POST", "/claim", claim)
        world.leases.update({x["key"]: x["lease_id"] for x in answer.json()["leases"]})
        return set(world.leases) == set(DUE_KEYS)

    wait_for(claim_all, 30, "every due key leased")
    world.done_key = DUE_KEYS[0]
    body = {"lease_id": world.leases.pop(world.done_key), "key": world.done_key, "result": 1}
    assert send_json(node, "POST", "/complete", body).status == 200

    def offered() -> bool:
        results = send_json(node, "GET", "/jobs/default/results?max=10").json()["results"]
        if results:
            world.offered_id = results[0]["id"]
        return bool(results)

    wait_for(offered, 30, "the result offered")
    wait_for(lambda: _quiet(world), 30, "the node's writes settled")


# -- bodies: malformed, truncated, msgpack, oversize --------------------------------------


POSTS = ["/rows", "/rows/delete", "/claim", "/complete", "/release", "/renew",
         "/jobs/default/ack", "/admin/unhold", "/admin/pause", "/admin/resume"]


@pytest.mark.parametrize("path", POSTS)
@pytest.mark.parametrize(
    ("body", "content_type", "code"),
    [
        (b"", JSON, "invalid_json"),
        (b'{"max": 1, "consumer": "w"', JSON, "invalid_json"),  # truncated
        (b'[{"key": "a", "route": "r"}', JSON, "invalid_json"),
        (b"\xff\xfe{}", JSON, "invalid_json"),
        (b'{"x": NaN}', JSON, "invalid_json"),
        (msgpack.packb({"max": 1, "consumer": "w"})[:-2], MSGPACK, "invalid_msgpack"),
        (b"\xc1", MSGPACK, "invalid_msgpack"),
        (b"\x81\xa3key\xa2\xff\xfe", MSGPACK, "invalid_msgpack"),  # a str that is not UTF-8
        (msgpack.packb({1: 2}), MSGPACK, "invalid_msgpack"),
        (b'{"keys": []}', MSGPACK, "invalid_msgpack"),  # JSON labelled msgpack
    ],
)
def test_malformed_and_truncated_bodies(
    world: World, path: str, body: bytes, content_type: str, code: str
) -> None:
    answer = unchanged(world, lambda: send(world.node, "POST", path, body, content_type))
    assert_error(answer, 400, code)


@pytest.mark.parametrize(
    ("path", "obj", "code", "field"),
    [
        ("/rows", {"key": "a", "route": "r"}, "invalid_body", "rows"),
        ("/rows/delete", ["a"], "invalid_body", None),
        ("/claim", [1], "invalid_body", None),
        ("/complete", "x", "invalid_body", None),
        ("/jobs/default/ack", {"ids": "1"}, "invalid_ids", "ids"),
        ("/jobs/default/ack", {}, "missing_field", "ids"),
        ("/admin/unhold", {"keys": [1]}, "invalid_key", "keys[0]"),
        ("/admin/pause", {"route": 5}, "invalid_route", "route"),
        ("/admin/pause", {"route": "r", "all": True}, "unknown_field", "all"),
        ("/release", {"lease_id": 1, "key": "due-1", "error": 7}, "invalid_error", "error"),
        ("/complete", {"lease_id": 1, "key": "due-1"}, "missing_field", "result"),
        ("/complete", {"lease_id": True, "key": "due-1", "result": 1}, "invalid_lease_id",
         "lease_id"),
        ("/complete", {"lease_id": 1 << 64, "key": "due-1", "result": 1}, "invalid_lease_id",
         "lease_id"),
    ],
)
def test_wrong_types_and_missing_fields_in_msgpack(
    world: World, path: str, obj: Any, code: str, field: str | None
) -> None:
    """The same rules in msgpack (JSON is covered in-process)."""
    if isinstance(obj, dict) and obj.get("lease_id") == 1 << 64:
        body = json.dumps(obj).encode()  # msgpack cannot carry 2**64
        answer = unchanged(world, lambda: send(world.node, "POST", path, body))
    else:
        body = msgpack.packb(obj, use_bin_type=True)
        answer = unchanged(world, lambda: send(world.node, "POST", path, body, MSGPACK))
    assert_error(answer, 400, code, field)


def test_msgpack_answers_errors_in_msgpack(world: World) -> None:
    answer = unchanged(
        world,
        lambda: send(world.node, "POST", "/claim", msgpack.packb({"max": 0, "consumer": "w"}),
                     MSGPACK, headers={"Accept": MSGPACK}),
    )
    assert answer.status == 400 and answer.headers["Content-Type"].startswith(MSGPACK)
    assert msgpack.unpackb(answer.raw)["error"]["code"] == "invalid_max"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_16_mib_is_413(world: World, chunked: bool) -> None:
    body = b"[" + b" " * (16 * MIB - 1) + b"]"  # 16 MiB + 1 byte of valid JSON
    answer = unchanged(world, lambda: send(world.node, "POST", "/rows", body, chunked=chunked))
    assert_error(answer, 413, "body_too_large")


def test_a_body_cut_off_by_the_client_changes_nothing(world: World) -> None:
    """Content-Length promises more than the client sends before it hangs up
    its side: the worker answers 400 or nothing, and goes on serving."""
    host, port = world.node.info["http"].rsplit(":", 1)

    def cut_off() -> Answer:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /rows HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b'Content-Length: 1000\r\n\r\n[{"key": "cut", "route": "r"}')
            sock.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        status = int(answer.split(b" ", 2)[1]) if answer else 0
        return Answer(status, {}, answer)

    answer = unchanged(world, cut_off)
    assert answer.status in (0, 400), answer.raw[:300]
    assert send_json(world.node, "GET", "/rows?key=cut").status == 404


def test_a_request_line_too_long_is_400_and_one_log_line(world: World) -> None:
    """A request aiohttp cannot parse (a request line over its 8,190 bytes,
    as the fuzz sent) is answered 400 before any handler; the worker logs one
    line for it, not a traceback, and goes on serving. The answer has the
    JSON error shape, as every error does."""
    host, port = world.node.info["http"].rsplit(":", 1)

    def too_long() -> Answer:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            path = "/jobs/j/results?" + "&".join(["wait_s=-3.5e%2B155"] * 600)
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        return Answer(int(answer.split(b" ", 2)[1]), {}, answer)

    answer = unchanged(world, too_long)
    assert answer.status == 400, answer.raw[:300]
    head, _, body = answer.raw.partition(b"\r\n\r\n")
    assert b"application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert error["code"] == "bad_request" and error["field"] is None, error
    assert "8190" in error["message"], error
    deadline = time.monotonic() + 10
    log_path = world.node.log_path
    while "action=http_bad_request" not in (text := log_path.read_text(errors="replace")):
        assert time.monotonic() < deadline, "no http_bad_request line in the node's log"
        time.sleep(0.02)  # a polling interval: the worker writes the line after answering
    assert "Traceback" not in text
    assert send_json(world.node, "GET", "/healthz").status == 200


# -- fields out of range ---------------------------------------------------------------------


def test_a_batch_with_one_bad_row_writes_nothing(world: World) -> None:
    rows = [{"key": "new-1", "route": "r"}, {"key": "new-2", "route": "r", "due_at": -5},
            {"key": DUE_KEYS[1], "route": "r", "cadence_s": 120}]
    answer = unchanged(world, lambda: send_json(world.node, "POST", "/rows", rows))
    assert_error(answer, 400, "invalid_due_at", "rows[1].due_at")
    assert send_json(world.node, "GET", "/rows?key=new-1").status == 404


@pytest.mark.parametrize(
    ("row", "code", "field"),
    [
        ({"key": "", "route": "r"}, "invalid_key", "rows[0].key"),
        ({"key": "k" * 1025, "route": "r"}, "invalid_key", "rows[0].key"),
        ({"key": "é" * 512 + "k", "route": "r"}, "invalid_key", "rows[0].key"),  # 1,025 bytes
        ({"key": "a", "route": "r", "job": "has space"}, "invalid_job", "rows[0].job"),
        ({"key": "a", "route": "r", "job": "j" * 129}, "invalid_job", "rows[0].job"),
        ({"key": "a", "route": "r", "job": "é"}, "invalid_job", "rows[0].job"),
        ({"key": "a", "route": "r", "job": ""}, "invalid_job", "rows[0].job"),
        ({"key": "a", "route": "r", "payload": "x" * (MIB - 1)}, "payload_too_large",
         "rows[0].payload"),
        ({"key": "a", "route": "r", "cadence_s": 59}, "invalid_cadence", "rows[0].cadence_s"),
        ({"key": "a", "route": "r", "cadence_s": 31_536_001}, "invalid_cadence",
         "rows[0].cadence_s"),
        ({"key": "a", "route": "r", "due_at": 32_503_680_001}, "invalid_due_at",
         "rows[0].due_at"),
        ({"key": "a", "route": "r", "due_at": 1e400}, "invalid_due_at", "rows[0].due_at"),
    ],
)
def test_row_fields_out_of_range(world: World, row: dict, code: str, field: str) -> None:
    # 1e400 is valid JSON (a float that overflows to inf); json.dumps would
    # write it as Infinity, which is not. msgpack carries inf as it is.
    as_json = json.dumps([row]).replace("Infinity", "1e400").encode()
    for body, content_type in ((as_json, JSON), (msgpack.packb([row]), MSGPACK)):
        answer = unchanged(world, partial(send, world.node, "POST", "/rows", body, content_type))
        assert_error(answer, 400, code, field)


@pytest.mark.parametrize(
    "value",
    [1 << 64, -(1 << 63) - 1, 10**30, "\ud800", {"a": [1, {"b": 1 << 70}]}],
    ids=["2**64", "below -2**63", "10**30", "a lone surrogate", "nested"],
)
def test_a_payload_or_result_msgpack_cannot_carry_is_refused(world: World, value: Any) -> None:
    """Every answer comes in JSON or msgpack, as the caller asks: what only
    JSON carries is refused where it comes in. (Was accepted; then every
    msgpack claim or poll that reached it answered 500, and the claim's
    other leases stayed leased to nobody: test_unsendable_payloads.py.)"""
    body = json.dumps([{"key": "a", "route": "r", "payload": value}]).encode()
    answer = unchanged(world, partial(send, world.node, "POST", "/rows", body))
    error = assert_error(answer, 400, "invalid_payload", "rows[0].payload")
    assert "msgpack cannot carry" in error["message"]
    key, lease_id = next(iter(world.leases.items()))
    body = json.dumps({"lease_id": lease_id, "key": key, "result": value}).encode()
    answer = unchanged(world, partial(send, world.node, "POST", "/complete", body))
    error = assert_error(answer, 400, "invalid_result", "result")
    assert "msgpack cannot carry" in error["message"]


def test_the_limits_themselves_are_accepted(world: World) -> None:
    """The boundaries of the refusals above: a key of exactly 1,024 bytes and
    a payload of exactly 1 MiB encoded go in (and are deleted again)."""
    key = "é" * 512
    rows = [{"key": key, "route": "r", "due_at": time.time() + 7200,
             "payload": "x" * (MIB - 2)}]
    assert send_json(world.node, "POST", "/rows", rows).json() == {"upserted": 1}
    assert send_json(world.node, "GET", f"/rows?key={quote(key)}").status == 200
    assert send_json(world.node, "POST", "/rows/delete", {"keys": [key]}).json() == {"deleted": 1}
    wait_for(lambda: _quiet(world), 30, "the node's writes settled")


def test_odd_but_valid_keys_travel_the_whole_stack(world: World) -> None:
    """The edges of what is valid go through the lease table (shared memory,
    fixed-size slots), the ledger and back unchanged: a NUL inside a key and
    a key that is only a NUL (no C string may cut them), 1,024 bytes in
    1-, 2- and 4-byte characters, a line separator."""
    node = world.node
    keys = ["odd\u0000b", "\u0000", "é" * 512, "k" * 1024, "😀" * 256, "x\u2028y"]
    now = time.time()
    rows = [{"key": k, "route": "r", "due_at": now - 60, "job": "odd", "payload": {"k": k}}
            for k in keys]
    assert send_json(node, "POST", "/rows", rows).json() == {"upserted": len(keys)}
    granted: dict[str, dict] = {}

    def claim() -> bool:
        answer = send_json(node, "POST", "/claim", {"max": 100, "consumer": "odd\u0000c"})
        granted.update({x["key"]: x for x in answer.json()["leases"]})
        return len(granted) == len(keys)

    wait_for(claim, 30, "every odd key granted")
    assert sorted(granted) == sorted(keys)
    assert all(granted[k]["payload"] == {"k": k} for k in keys)
    for key, lease in granted.items():
        body = {"lease_id": lease["lease_id"], "key": key, "result": key}
        assert send_json(node, "POST", "/complete", body).status == 200
    results = send(node, "GET", "/jobs/odd/results?max=100").json()["results"]
    assert sorted(r["key"] for r in results) == sorted(keys)
    assert all(r["result"] == r["key"] for r in results)
    ids = [r["id"] for r in results]
    assert send_json(node, "POST", "/jobs/odd/ack", {"ids": ids}).json() == {"acked": len(keys)}
    for key in keys:
        assert send(node, "GET", f"/rows?key={quote(key)}").json()["row"]["key"] == key
    wait_for(lambda: _quiet(world), 30, "the node's writes settled")


def test_keys_that_are_not_valid_utf8(world: World) -> None:
    node = world.node
    cases = [
        # a lone surrogate, escaped in JSON
        lambda: send(node, "POST", "/rows", b'[{"key": "\\ud800", "route": "r"}]'),
        lambda: send(node, "POST", "/rows/delete", b'{"keys": ["a\\udfff"]}'),
        # bytes in msgpack are not a string
        lambda: send(node, "POST", "/rows",
                     msgpack.packb([{"key": b"\xff", "route": "r"}], use_bin_type=True), MSGPACK),
        lambda: send(node, "POST", "/complete",
                     msgpack.packb({"lease_id": 1, "key": b"k", "result": 1}, use_bin_type=True),
                     MSGPACK),
        # percent-encoding that does not decode as UTF-8
        lambda: send(node, "GET", "/rows?key=%FF"),
        lambda: send(node, "GET", "/rows?key=due-1%C0"),
        lambda: send(node, "GET", "/rows?key=%ED%A0%80"),  # an encoded surrogate
        lambda: send(node, "GET", "/rows?key="),
        lambda: send(node, "GET", "/rows?key=" + "k" * 1025),
    ]
    for request in cases:
        assert_error(unchanged(world, request), 400, "invalid_key")
    # U+FFFD itself is a valid key: looked up, and not there
    assert_error(send(node, "GET", "/rows?key=%EF%BF%BD"), 404, "not_found", "key")
    assert send(node, "GET", f"/rows?key={quote(DUE_KEYS[1])}").status == 200


def test_a_str_that_is_not_utf8_in_msgpack_is_invalid_msgpack(world: World) -> None:
    body = b"\x91\x82\xa3key\xa2\xc3\x28\xa5route\xa1r"  # [{"key": <bad str>, "route": "r"}]
    answer = unchanged(world, lambda: send(world.node, "POST", "/rows", body, MSGPACK))
    assert_error(answer, 400, "invalid_msgpack")


def test_too_many_classes(world: World) -> None:
    rows = [{"key": f"class-{i}", "route": "r", "cadence_s": 60 * (i + 2)}
            for i in range(MAX_CLASSES + 1)]
    answer = unchanged(world, lambda: send_json(world.node, "POST", "/rows", rows))
    assert_error(answer, 400, "too_many_classes")


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ({"max": 0, "consumer": "w"}, "invalid_max", "max"),
        ({"max": 10_001, "consumer": "w"}, "invalid_max", "max"),
        ({"max": 1.0, "consumer": "w"}, "invalid_max", "max"),
        ({"max": 1, "consumer": "w", "lease_s": 0}, "invalid_lease_s", "lease_s"),
        ({"max": 1, "consumer": "w", "lease_s": 86_401}, "invalid_lease_s", "lease_s"),
        ({"max": 1, "consumer": "w", "lease_s": -1}, "invalid_lease_s", "lease_s"),
        ({"max": 1, "consumer": "é" * 65}, "invalid_consumer", "consumer"),
    ],
)
def test_out_of_range_claims(world: World, body: dict, code: str, field: str) -> None:
    answer = unchanged(world, lambda: send_json(world.node, "POST", "/claim", body))
    assert_error(answer, 400, code, field)


def test_out_of_range_renewals(world: World) -> None:
    key, lease_id = next(iter(world.leases.items()))
    for lease_s in (0, 0.5, 86_401, "60", None):
        body = {"lease_id": lease_id, "key": key, "lease_s": lease_s}
        answer = unchanged(world, partial(send_json, world.node, "POST", "/renew", body))
        assert_error(answer, 400, "invalid_lease_s", "lease_s")


@pytest.mark.parametrize(
    ("query", "code", "field"),
    [
        ("/results?max=0", "invalid_max", "max"),
        ("/results?max=10001", "invalid_max", "max"),
        ("/results?max=-1", "invalid_max", "max"),
        ("/results?max=1.5", "invalid_max", "max"),
        ("/results?max=1_0", "invalid_max", "max"),
        ("/results?max=%201", "invalid_max", "max"),
        ("/results?max=" + "9" * 5000, "invalid_max", "max"),
        ("/jobs/default/results?wait_s=61", "invalid_wait_s", "wait_s"),
        ("/jobs/default/results?wait_s=-0.1", "invalid_wait_s", "wait_s"),
        ("/jobs/default/results?wait_s=nan", "invalid_wait_s", "wait_s"),
        ("/jobs/default/results?wait_s=inf", "invalid_wait_s", "wait_s"),
        ("/jobs/default/results?wait_s=soon", "invalid_wait_s", "wait_s"),
        ("/leases?limit=0", "invalid_limit", "limit"),
        ("/held?limit=10001", "invalid_limit", "limit"),
        ("/queue-state?scope=world", "invalid_scope", "scope"),
        ("/jobs/has%20space/results", "invalid_job", "job"),
        ("/jobs/" + "j" * 129 + "/results", "invalid_job", "job"),
        ("/jobs/%FF/results", "invalid_job", "job"),
        # unknown query parameters are refused as unknown body fields are
        ("/results?maxx=5", "unknown_field", "maxx"),
        ("/jobs/default/results?max=5&wait=1", "unknown_field", "wait"),
        ("/leases?limt=5", "unknown_field", "limt"),
        ("/held?limit=5&parked=1", "unknown_field", "parked"),
        ("/rows?key=due-1&version=3", "unknown_field", "version"),
        ("/queue-state?scope=cluster&x=1", "unknown_field", "x"),
        # a parameter given twice: which value was meant is the caller's to say
        ("/jobs/default/results?wait_s=0&wait_s=soon", "invalid_wait_s", "wait_s"),
        ("/results?max=5&max=6", "invalid_max", "max"),
        ("/leases?limit=5&limit=5", "invalid_limit", "limit"),
        ("/rows?key=due-1&key=due-2", "invalid_key", "key"),
        ("/queue-state?scope=cluster&scope=cluster", "invalid_scope", "scope"),
    ],
)
def test_out_of_range_query_parameters(world: World, query: str, code: str, field: str) -> None:
    answer = unchanged(world, lambda: send(world.node, "GET", query))
    assert_error(answer, 400, code, field)


# -- leases that are not the caller's -----------------------------------------------------


@pytest.mark.parametrize("path", ["/complete", "/release", "/renew"])
def test_forged_lease_ids(world: World, path: str) -> None:
    key, lease_id = next(iter(world.leases.items()))
    other_key, other_id = list(world.leases.items())[1]
    extra = {"/complete": {"result": 1}, "/release": {}, "/renew": {"lease_s": 30}}[path]
    for forged in ({"lease_id": lease_id + 1, "key": key},  # a guess next to a real one
                   {"lease_id": other_id, "key": key},  # a real lease of another key
                   {"lease_id": lease_id, "key": "later-0"},  # a real lease, a key not leased
                   {"lease_id": lease_id, "key": "no-such-key"},
                   {"lease_id": (1 << 64) - 1, "key": key}):
        body = {**forged, **extra}
        answer = unchanged(world, partial(send_json, world.node, "POST", path, body))
        assert_error(answer, 409, "lease_unknown", "lease_id")
    assert other_key != key


def test_a_completion_for_someone_elses_lease(world: World) -> None:
    """c1's lease runs out, c2 is granted the key: c1's completion, renewal
    and release are refused as lease_conflict, and c2's lease is untouched."""
    node = world.node
    key = "theirs"
    rows = [{"key": key, "route": "r", "due_at": time.time() - 600}]
    assert send_json(node, "POST", "/rows", rows).status == 200
    first = wait_for(
        lambda: send_json(node, "POST", "/claim",
                          {"max": 1, "consumer": "c1", "lease_s": 1}).json()["leases"],
        30, "c1's grant")
    assert first[0]["key"] == key

    def granted_to_c2() -> list:
        answer = send_json(node, "POST", "/claim", {"max": 1, "consumer": "c2", "lease_s": 600})
        return answer.json()["leases"]

    second = wait_for(granted_to_c2, 60, "the key granted to c2 after c1's lease ran out")
    assert second[0]["key"] == key and second[0]["lease_id"] != first[0]["lease_id"]
    world.leases[key] = second[0]["lease_id"]
    wait_for(lambda: _quiet(world), 30, "the node's writes settled")
    stale = {"lease_id": first[0]["lease_id"], "key": key}
    for path, extra in (("/complete", {"result": "late"}), ("/renew", {"lease_s": 30}),
                        ("/release", {"error": "mine"})):
        answer = unchanged(world, partial(send_json, node, "POST", path, {**stale, **extra}))
        assert_error(answer, 409, "lease_conflict", "lease_id")
    live = {x["key"]: x for x in send_json(node, "GET", "/leases").json()["leases"]}
    assert live[key]["lease_id"] == second[0]["lease_id"] and live[key]["consumer"] == "c2"


# -- acks ------------------------------------------------------------------------------------


def test_ack_of_ids_never_offered_acks_nothing(world: World) -> None:
    never = world.offered_id + 1000
    body = {"ids": [world.offered_id, never]}
    answer = unchanged(world, lambda: send_json(world.node, "POST", "/jobs/default/ack", body))
    error = assert_error(answer, 409, "never_offered", "ids")
    assert str(never) in error["message"]
    # another job never offered this one
    body = {"ids": [world.offered_id]}
    answer = unchanged(world, lambda: send_json(world.node, "POST", "/jobs/other/ack", body))
    assert_error(answer, 409, "never_offered", "ids")
    # the refused requests acked nothing: acking the offered id alone now
    # moves the ledger's count by one
    before = send_json(world.node, "GET", "/accounting").json()["acknowledged"]
    answer = send_json(world.node, "POST", "/jobs/default/ack", {"ids": [world.offered_id]})
    assert answer.status == 200 and answer.json() == {"acked": 1}
    after = send_json(world.node, "GET", "/accounting").json()["acknowledged"]
    assert after == before + 1
    wait_for(lambda: _quiet(world), 30, "the node's writes settled")


@pytest.mark.parametrize("id_", [1 << 63, (1 << 64) - 1, 1 << 64, 1 << 70, 10**30])
def test_ack_of_an_id_past_64_bits_is_never_offered(world: World, id_: int) -> None:
    """Regression: an id past 2**64 was a 500 (msgpack cannot carry it to the
    ledger). No id that large was ever offered."""
    never = world.offered_id + 1000
    body = {"ids": [world.offered_id, id_, never]}
    answer = unchanged(world, lambda: send_json(world.node, "POST", "/jobs/default/ack", body))
    error = assert_error(answer, 409, "never_offered", "ids")
    # every id never offered named (the one the ledger never held too), no other
    parts = error["message"].split("; ")
    named = {n for part in parts for n in part.split("offered: ")[1].split(", ")}
    assert named == {str(id_), str(never)}, error


@pytest.mark.parametrize(
    ("ids", "code"),
    [([-1], "invalid_ids"), ([1.0], "invalid_ids"), ([True], "invalid_ids"),
     (["1"], "invalid_ids"), ([None], "invalid_ids"), (list(range(10_001)), "too_many_ids")],
)
def test_ack_ids_of_the_wrong_type(world: World, ids: list, code: str) -> None:
    body = {"ids": ids}
    answer = unchanged(world, lambda: send_json(world.node, "POST", "/jobs/default/ack", body))
    assert_error(answer, 400, code)


# -- paths and methods ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status", "code", "allow"),
    [
        ("GET", "/nope", 404, "not_found", None),
        ("POST", "/nope", 404, "not_found", None),
        ("GET", "/jobs/default", 404, "not_found", None),
        ("GET", "/console/../node.json", 404, "not_found", None),
        ("GET", "/console/secret.txt", 404, "not_found", None),
        ("GET", "/claim", 405, "method_not_allowed", "POST"),
        ("PUT", "/rows", 405, "method_not_allowed", "POST"),
        ("DELETE", "/rows", 405, "method_not_allowed", "GET"),
        ("POST", "/accounting", 405, "method_not_allowed", "GET"),
        ("PATCH", "/jobs/default/ack", 405, "method_not_allowed", "POST"),
        ("POST", "/jobs/default/results", 405, "method_not_allowed", "GET"),
        ("POST", "/queue-state", 405, "method_not_allowed", "GET"),
    ],
)
def test_unknown_paths_and_wrong_methods(
    world: World, method: str, path: str, status: int, code: str, allow: str | None
) -> None:
    answer = unchanged(world, lambda: send(world.node, method, path, b"{}"))
    assert_error(answer, status, code, None)
    if allow is not None:
        assert allow in answer.headers["Allow"]


# -- configuration and import files --------------------------------------------------------


def _run_node(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("content", "line"),
    [
        (b"lease_s = 30\nworkers = \n", 2),  # not TOML
        (b"lease_s = 30\n\xff\xfe = 1\n", None),  # not UTF-8 (was a traceback, exit 1)
        (b'lease_s = 30\n[routes.p]\ncadence_s = 600\nsitemap_boost = "a"\n', 4),
    ],
    ids=["not-toml", "not-utf8", "bad-value"],
)
def test_config_file_with_errors_exits_2_naming_the_file(
    tmp_path: Path, content: bytes, line: int | None
) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_bytes(content)
    out = _run_node(tmp_path, "run", "--config", str(cfg), "--data-dir", str(tmp_path / "d"))
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(cfg) in lines[0], out.stderr
    if line is not None:
        assert f"{cfg}:{line}" in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "d" / "schedule.db").exists()


@pytest.mark.parametrize("damage", ["cut", "corrupt", "crc"])
def test_broken_gzip_import_imports_nothing(tmp_path: Path, damage: str) -> None:
    """Regression: a gzip file cut short was a traceback with exit 1."""
    lines = "".join(json.dumps({"key": f"k{i}", "route": "r"}) + "\n" for i in range(5000))
    data = gzip.compress(lines.encode())
    if damage == "cut":
        data = data[: len(data) // 2]
    elif damage == "corrupt":
        data = data[:10] + bytes(b ^ 0x5A for b in data[10:40]) + data[40:]
    else:  # the trailer's CRC
        data = data[:-8] + b"\0\0\0\0" + data[-4:]
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(data)
    for extra in ([], ["--skip-invalid"]):
        out = _run_node(tmp_path, "import", str(path), "--data-dir", str(tmp_path / "d"), *extra)
        assert out.returncode == 2, out
        assert "Traceback" not in out.stderr
        assert str(path) in out.stderr and "gzip" in out.stderr, out.stderr
    db = tmp_path / "d" / "schedule.db"
    if db.exists():
        conn = sqlite3.connect(db)
        try:
            assert conn.execute("SELECT count(*) FROM schedule").fetchone()[0] == 0
        finally:
            conn.close()
