"""``node.client.Client``'s wire, against a real HTTP server in a thread that
records what each request carried and answers in the encoding it was asked
for (as the node does): msgpack both ways by default, bytes raw; a body
msgpack cannot carry sent as JSON; ``wire="json"`` as before; an answer
decoded by its content type."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgpack
import pytest

from node.client import Client, ClientError

pytestmark = pytest.mark.timeout(30)

MSGPACK = "application/msgpack"


class _Recorder(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]] = []
    answer: Any = {"ok": True}
    status = 200

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        kind = self.headers["Content-Type"]
        body = (msgpack.unpackb(raw, raw=False, strict_map_key=False) if kind == MSGPACK
                else json.loads(raw))  # fmt: skip
        self.seen.append({"path": self.path, "type": kind, "accept": self.headers["Accept"],
                          "body": body})  # fmt: skip
        self._answer()

    def do_GET(self) -> None:  # noqa: N802
        self.seen.append({"path": self.path, "accept": self.headers["Accept"]})
        self._answer()

    def _answer(self) -> None:
        packed = MSGPACK in (self.headers["Accept"] or "")
        raw = msgpack.packb(self.answer, use_bin_type=True) if packed else json.dumps(
            self.answer).encode()  # fmt: skip
        self.send_response(self.status)
        self.send_header("Content-Type", MSGPACK if packed else "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Recorder.seen = []
    _Recorder.answer, _Recorder.status = {"ok": True}, 200
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_msgpack_by_default_bytes_raw(server: str) -> None:
    _Recorder.answer = {"items": [{"id": 7, "outcome": "ok"}]}
    with Client(server) as client:
        assert client.complete_many([(1, "k", b"\x00\xff")]) == [7]
    (seen,) = _Recorder.seen
    assert (seen["type"], seen["accept"]) == (MSGPACK, MSGPACK)
    assert seen["body"] == {"items": [{"lease_id": 1, "key": "k", "result": b"\x00\xff"}]}


def test_a_body_msgpack_cannot_carry_goes_as_json(server: str) -> None:
    with Client(server) as client:
        client.request("POST", "/rows", [{"key": "k", "route": "r", "payload": 1 << 70}])
    (seen,) = _Recorder.seen
    assert seen["type"] == "application/json" and seen["accept"] == MSGPACK
    assert seen["body"][0]["payload"] == 1 << 70


def test_the_json_wire_is_the_old_one(server: str) -> None:
    with Client(server, wire="json") as client:
        _Recorder.answer = {"id": 5}
        assert client.complete(1, "k", b"\x01") == 5
        _Recorder.answer = {"results": [{"id": 5, "key": "k", "job": "j", "finished_at": 1.0,
                                         "result": base64.b64encode(b"\x01").decode(),
                                         "encoding": "base64"}]}  # fmt: skip
        (result,) = client.poll("j")
    assert result["result"] == b"\x01" and "encoding" not in result
    complete, poll = _Recorder.seen
    assert complete["type"] == "application/json" and complete["accept"] == "application/json"
    assert complete["body"] == {"lease_id": 1, "key": "k", "result": "AQ==", "encoding": "base64"}
    assert poll["accept"] == "application/json"


def test_an_error_answer_in_msgpack_is_a_client_error(server: str) -> None:
    _Recorder.status = 409
    _Recorder.answer = {"error": {"code": "lease_unknown", "message": "no such lease",
                                  "field": "lease_id"}}  # fmt: skip
    with Client(server) as client, pytest.raises(ClientError) as refused:
        client.complete(1, "k", {"x": 1})
    assert (refused.value.status, refused.value.code, refused.value.field) == (
        409, "lease_unknown", "lease_id")  # fmt: skip


def test_an_unknown_wire_is_refused() -> None:
    with pytest.raises(ValueError, match="wire"):
        Client("http://127.0.0.1:9", wire="xml")


def test_a_body_the_node_refuses_as_msgpack_is_sent_again_as_json(server: str) -> None:
    """A map key that is no str packs, but the node reads msgpack strictly
    (400 invalid_msgpack, nothing applied): the client sends that body again
    as JSON, which turns the key into a string as the old wire did."""
    calls = {"n": 0}
    real = _Recorder._answer

    def first_refused(self: _Recorder) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            _Recorder.status = 400
            _Recorder.answer = {"error": {"code": "invalid_msgpack", "message": "map key",
                                          "field": None}}  # fmt: skip
        else:
            _Recorder.status, _Recorder.answer = 200, {"upserted": 1}
        real(self)

    _Recorder._answer = first_refused  # type: ignore[method-assign]
    try:
        with Client(server) as client:
            assert client.upsert([{"key": "k", "route": "r", "payload": {1: "x"}}]) == 1
    finally:
        _Recorder._answer = real  # type: ignore[method-assign]
    first, again = _Recorder.seen
    assert first["type"] == MSGPACK and again["type"] == "application/json"
    assert again["body"][0]["payload"] == {"1": "x"}
