"""``node.client``'s reading of an answer's head (``_read_header_block``,
``_Response``) against http.client's own: the same fields from the same
bytes, the same limits, and whole answers from a real server over a real
socket (a length, chunks, an HTTP/1.0 answer that closes, a 204, a 100
Continue before the answer), each read by ``Client`` as http.client would."""

from __future__ import annotations

import http.client
import io
import socket
import threading
from collections.abc import Iterator

import pytest

from node.client import Client, ClientError, _read_header_block, _Response

pytestmark = pytest.mark.timeout(30)

BLOCKS = [
    b"Content-Type: application/msgpack\r\nContent-Length: 12\r\n\r\n",
    b"content-length:7\r\nX-Empty:\r\nX-Spaced:   a b  \r\n\r\n",
    b"Set-Cookie: a=1\r\nSet-Cookie: b=2\r\nDate: Sat, 05 Dec 2026 07:30:00 GMT\r\n\r\n",
    b"X-Latin: caf\xe9\r\nServer: x\n\n",  # bare LF, a byte past ASCII
    b"X-Folded: one\r\n  two\r\n\tthree\r\nAfter: 1\r\n\r\n",
    b"\r\n",  # no fields
    b"Only: this",  # the stream ends without the blank line
]


def _fields(msg: http.client.HTTPMessage) -> list[tuple[str, str]]:
    return list(msg.items())


@pytest.mark.parametrize("block", BLOCKS)
def test_the_same_fields_as_http_client(block: bytes) -> None:
    ours = _read_header_block(io.BytesIO(block))
    theirs = http.client.parse_headers(io.BytesIO(block))
    assert isinstance(ours, http.client.HTTPMessage)
    assert _fields(ours) == _fields(theirs)
    assert ours.get_all("set-cookie") == theirs.get_all("set-cookie")


def test_the_rest_of_the_stream_is_left_unread() -> None:
    fp = io.BytesIO(b"A: 1\r\n\r\nbody bytes")
    _read_header_block(fp)
    assert fp.read() == b"body bytes"


def test_http_clients_limits() -> None:
    too_many = b"".join(b"X-%d: v\r\n" % i for i in range(101)) + b"\r\n"
    with pytest.raises(http.client.HTTPException, match="more than 100 headers"):
        _read_header_block(io.BytesIO(too_many))
    long_line = b"X-Long: " + b"a" * 70_000 + b"\r\n\r\n"
    with pytest.raises(http.client.LineTooLong):
        _read_header_block(io.BytesIO(long_line))


# -- whole heads, against http.client's own HTTPResponse ----------------------------------

OK = b"HTTP/1.1 200 OK\r\n"
HEADS = {
    "plain": OK + b"Content-Type: a/b\r\nContent-Length: 2\r\n\r\nhi",
    "http/1.0": b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi",
    "http/1.0 kept": b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 2\r\n\r\nhi",
    "close": OK + b"Connection: close\r\nContent-Length: 2\r\n\r\nhi",
    "chunked": OK + b"Transfer-Encoding: Chunked\r\nContent-Length: 9\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
    "two lengths": OK + b"Content-Length: 2\r\nContent-Length: 5\r\n\r\nhiXXX",
    "bad length": OK + b"Content-Length: -1\r\n\r\nhi",
    "204": b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n",
    "100 first": b"HTTP/1.1 100 Continue\r\nX: 1\r\n\r\n" + OK + b"Content-Length: 2\r\n\r\nhi",
    "bad version": b"HTTP/2.0 200 OK\r\n\r\n",
    "cut in the head": OK + b"Content-Type: a/b\r\nContent-Len",
    "bare LF": b"HTTP/1.1 200 OK\nContent-Length: 2\n\nhi",
    "no colon": OK + b"garbage line\r\nContent-Length: 2\r\n\r\nhi",
    "space in a name": OK + b"Bad Name: x\r\nContent-Length: 2\r\n\r\nhi",
    "folded": OK + b"X-F: one\r\n two\r\n\tthree\r\nContent-Length: 2\r\n\r\nhi",
    "folded first": OK + b" X-F: one\r\nContent-Length: 2\r\n\r\nhi",
    "bare CR": OK + b"X: a\rContent-Length: 2\r\n\r\nhi",
    "no name": OK + b": v\r\nContent-Length: 2\r\n\r\nhi",
    "envelope": OK + b"From x\r\nContent-Length: 2\r\n\r\nhi",
    "blanks kept": OK + b"Content-Type: \t a/b  \r\nContent-Length: 2\r\n\r\nhi",
    "99 headers": OK + b"".join(b"X-%d: v\r\n" % i for i in range(99)) + b"\r\n",
    "100 headers": OK + b"".join(b"X-%d: v\r\n" % i for i in range(100)) + b"\r\n",
    "101 folds": OK + b"X: a\r\n" + b" b\r\n" * 101 + b"\r\n",
    "101 lines, no colon": OK + b"junk\r\n" * 101 + b"Content-Length: 2\r\n\r\nhi",
    "a long line": OK + b"X: " + b"a" * 70_000 + b"\r\n\r\n",
}


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def makefile(self, mode: str) -> io.BytesIO:
        return io.BytesIO(self.data)


def _read(kind: type[http.client.HTTPResponse], data: bytes) -> object:
    answer = kind(_Bytes(data))  # type: ignore[arg-type]
    try:
        answer.begin()
        body = answer.read()
    except Exception as exc:  # noqa: BLE001 - the exception is the outcome compared
        return type(exc).__name__, str(exc)
    return (answer.status, answer.reason, answer.version, answer.chunked, answer.will_close,
            answer.length, list(answer.headers.items()), body)  # fmt: skip


@pytest.mark.parametrize("name", list(HEADS))
def test_a_head_reads_as_http_client_reads_it(name: str) -> None:
    assert _read(_Response, HEADS[name]) == _read(http.client.HTTPResponse, HEADS[name])


# -- whole answers over a socket ---------------------------------------------------------

BODY = b'{"ok": true}'
REFUSAL = b'{"error": {"code": "lease_conflict", "message": "no"}}'
ANSWERS = {
    "/length": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY,
    "/chunked": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n5\r\n" + BODY[:5] + b"\r\n7\r\n" + BODY[5:]
    + b"\r\n0\r\n\r\n",
    "/old": b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + BODY,
    "/close": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY,
    "/nothing": b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n",
    "/continue": b"HTTP/1.1 100 Continue\r\nX-Interim: 1\r\n\r\n"
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY,
    "/refused": b"HTTP/1.1 409 Conflict\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n" % len(REFUSAL) + REFUSAL,
}
CLOSES = {"/old", "/close"}


class _Server:
    """A socket server that answers each request with the bytes its path
    names, and counts the connections it accepted."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as rfile:
            while True:
                line = rfile.readline()
                if not line:
                    return
                path = line.split()[1].decode()
                length = 0
                while (header := rfile.readline()) not in (b"\r\n", b""):
                    name, _, value = header.decode().partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                rfile.read(length)
                conn.sendall(ANSWERS[path])
                if path in CLOSES:
                    return


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    srv = _Server()
    yield srv
    srv.sock.close()


@pytest.mark.parametrize("path", ["/length", "/chunked", "/old", "/close", "/continue"])
def test_answers_read_whole(server: _Server, path: str) -> None:
    with Client(f"http://127.0.0.1:{server.port}", wire="json") as client:
        assert client.request("GET", path) == {"ok": True}
        assert client.request("GET", "/length") == {"ok": True}  # the next one too


def test_a_kept_connection_is_reused_and_a_closed_one_is_not(server: _Server) -> None:
    with Client(f"http://127.0.0.1:{server.port}", wire="json") as client:
        before = server.connections
        for _ in range(3):
            client.request("GET", "/length")
            client.request("POST", "/chunked", {"a": 1})
        assert server.connections == before + 1
        client.request("GET", "/close")
        client.request("GET", "/length")
        assert server.connections == before + 2


def test_an_empty_answer_and_an_error(server: _Server) -> None:
    with Client(f"http://127.0.0.1:{server.port}", wire="json") as client:
        assert client.request("POST", "/nothing", {"a": 1}) is None
        with pytest.raises(ClientError) as err:
            client.request("GET", "/refused")
        assert (err.value.status, err.value.code) == (409, "lease_conflict")
        assert client.request("GET", "/length") == {"ok": True}
