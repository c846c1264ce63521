"""Local IPC to the ledger: length-prefixed msgpack frames over a UNIX socket.

The ledger process is the single writer of the completion log; workers,
inference processes and ``LocalClaimer`` send it results (and polls, acks)
over a UNIX socket in the abstract namespace, ``\0queue-node.<name>.ledger``
(the ledger accepts only peers of its own uid, and every client checks that
the ledger runs as its own uid before it sends anything: the abstract name has
no owner, so another user could bind it first). Nothing is unpickled: frames
are msgpack maps.

Frame: u32 big-endian body length, then the msgpack body. A request is
``{"op": str, "id": int, ...}``; its reply carries the same ``id`` and either
the answer's fields or ``{"error": {"code", "message"}}``. Requests on one
connection may be answered out of order (a long poll must not hold up a
completion), so clients match replies by id.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from node.core.errors import NodeError

_LEN = struct.Struct(">I")
# A frame larger than this is refused: results are at most a request body
# (16 MiB) plus framing.
MAX_FRAME = 32 << 20


class IpcError(NodeError):
    """The ledger could not be reached, or broke the protocol."""


class RemoteError(NodeError):
    """The ledger answered with an error."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(sock: Any) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a UNIX socket."""
    cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, _gid = _CRED.unpack(cred)
    return pid, uid


def check_peer(sock: Any, path: str) -> None:
    """IpcError unless the server at ``path`` runs as this uid.

    The ledger's name is abstract: anyone on the host can bind it first. A
    client that sent its results there, or believed its answers, would hand
    work to another user; so it checks who answered before a byte is sent."""
    pid, uid = peer_uid(sock)
    if uid != os.getuid():
        raise IpcError(
            f"{path.lstrip(chr(0))} is served by pid {pid} of uid {uid}, not by this "
            f"node's user (uid {os.getuid()}): refusing it"
        )


def pack(obj: dict[str, Any]) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def unpack(body: bytes) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.UnpackException) as exc:
        raise IpcError(f"malformed frame: {exc}") from None
    if not isinstance(obj, dict):
        raise IpcError("a frame must be a map")
    return obj


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next frame, or None at a clean end of stream."""
    try:
        head = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise IpcError("connection closed mid-frame") from None
        return None
    (length,) = _LEN.unpack(head)
    if length > MAX_FRAME:
        raise IpcError(f"frame of {length} bytes is over the {MAX_FRAME} limit")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise IpcError("connection closed mid-frame") from None
    return unpack(body)


def recv_frame(sock: socket.socket) -> dict[str, Any] | None:
    """The next frame on a blocking socket (a server thread's: the row
    service's), or None at a clean end of stream, between frames."""
    head = sock.recv(_LEN.size, socket.MSG_WAITALL)
    if not head:
        return None
    if len(head) < _LEN.size:  # a signal cut the wait short
        head += _recv_exactly(sock, _LEN.size - len(head), "the client")
    (length,) = _LEN.unpack(head)
    if length > MAX_FRAME:
        raise IpcError(f"frame of {length} bytes is over the {MAX_FRAME} limit")
    return unpack(_recv_exactly(sock, length, "the client"))


Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


async def serve(path: str, handler: Handler) -> asyncio.AbstractServer:
    """Serve frames on a UNIX socket; each request is handled in its own
    task so a long poll never blocks a completion on the same connection."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()
        tasks: set[asyncio.Task] = set()

        async def one(request: dict[str, Any]) -> None:
            try:
                reply = await handler(request)
            except RemoteError as exc:
                reply = {"error": {"code": exc.code, "message": exc.message}}
            reply["id"] = request.get("id")
            data = pack(reply)
            async with lock:
                writer.write(data)
                await writer.drain()

        try:
            while True:
                request = await read_frame(reader)
                if request is None:
                    break
                task = asyncio.create_task(one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (IpcError, ConnectionError):
            pass
        finally:
            for task in tasks:
                task.cancel()
            writer.close()

    old = os.umask(0o177)  # the socket file is created 0600
    try:
        return await asyncio.start_unix_server(on_connection, path=path, limit=MAX_FRAME)
    finally:
        os.umask(old)


class IpcClient:
    """A blocking client, one request at a time per thread (inference
    processes, LocalClaimer, the CLI). Reconnects on the next call after a
    failure; a failed call raises IpcError and is never retried silently.
    ``peer`` names the server in errors (the row service uses this client too)."""

    def __init__(self, path: str, timeout_s: float = 30.0, peer: str = "ledger") -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.peer = peer
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _connect(self) -> socket.socket:
        if self._sock is None or self._pid != os.getpid():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.path)
                check_peer(sock, self.path)
            except OSError as exc:
                sock.close()
                raise IpcError(
                    f"{self.peer} not reachable at {self.path}: {exc.strerror}"
                ) from None
            except IpcError:
                sock.close()
                raise
            self._sock = sock
            self._pid = os.getpid()
        return self._sock

    def call(self, op: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        with self._lock:
            sock = self._connect()
            request_id = next(self._ids)
            try:
                sock.settimeout(timeout_s or self.timeout_s)
                sock.sendall(pack({"op": op, "id": request_id, **fields}))
                while True:
                    reply = self._read(sock)
                    if reply.get("id") == request_id:
                        break
            except (OSError, IpcError) as exc:
                self.close()
                raise IpcError(f"{self.peer} call {op} failed: {exc}") from None
        error = reply.get("error")
        if error:
            raise RemoteError(error.get("code", "error"), error.get("message", ""))
        return reply

    def _read(self, sock: socket.socket) -> dict[str, Any]:
        head = _recv_exactly(sock, _LEN.size, self.peer)
        (length,) = _LEN.unpack(head)
        if length > MAX_FRAME:
            raise IpcError(f"frame of {length} bytes is over the limit")
        return unpack(_recv_exactly(sock, length, self.peer))

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None


def _recv_exactly(sock: socket.socket, n: int, peer: str = "ledger") -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise IpcError(f"{peer} closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


class AsyncIpcClient:
    """An asyncio client for the HTTP workers: many requests in flight on
    one connection, replies matched by id."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._ids = itertools.count(1)
        self._writer: asyncio.StreamWriter | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader_task: asyncio.Task | None = None
        self._connecting = asyncio.Lock()

    async def _connect(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self._writer is None or self._writer.is_closing():
                try:
                    reader, writer = await asyncio.open_unix_connection(self.path, limit=MAX_FRAME)
                except OSError as exc:
                    raise IpcError(f"ledger not reachable at {self.path}: {exc}") from None
                try:
                    check_peer(writer.get_extra_info("socket"), self.path)
                except IpcError:
                    writer.close()
                    raise
                self._writer = writer
                self._reader_task = asyncio.create_task(self._read_loop(reader))
            return self._writer

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                reply = await read_frame(reader)
                if reply is None:
                    break
                fut = self._waiting.pop(reply.get("id") or 0, None)  # ids start at 1
                if fut is not None and not fut.done():
                    fut.set_result(reply)
        except (IpcError, ConnectionError):
            pass
        finally:
            waiting, self._waiting = self._waiting, {}
            for fut in waiting.values():
                if not fut.done():
                    fut.set_exception(IpcError("ledger connection lost"))
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    async def call(self, op: str, timeout_s: float = 30.0, **fields: Any) -> dict[str, Any]:
        writer = await self._connect()
        request_id = next(self._ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        try:
            writer.write(pack({"op": op, "id": request_id, **fields}))
            await writer.drain()
            reply = await asyncio.wait_for(fut, timeout_s)
        except (TimeoutError, OSError) as exc:
            self._waiting.pop(request_id, None)
            raise IpcError(f"ledger call {op} failed: {exc!r}") from None
        error = reply.get("error")
        if error:
            raise RemoteError(error.get("code", "error"), error.get("message", ""))
        return reply

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
