"""The ledger's local IPC: frames, out-of-order replies, errors, limits."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import pytest

from node.ipc import AsyncIpcClient, IpcClient, IpcError, RemoteError, pack, serve


def _serve_in_thread(path: str, handler):
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    def run():
        asyncio.set_event_loop(loop)
        holder["server"] = loop.run_until_complete(serve(path, handler))
        started.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(10)

    def stop():
        async def close():
            holder["server"].close()
            await holder["server"].wait_closed()
        asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()
    return stop


async def _handler(request):
    op = request["op"]
    if op == "echo":
        return {"value": request["value"]}
    if op == "slow":
        await asyncio.sleep(request["s"])  # a stand-in for a long poll's wait
        return {"slow": True}
    raise RemoteError("unknown_op", f"no op {op}")


def test_blocking_client_round_trip_and_error(tmp_path):
    path = str(tmp_path / "l.sock")
    stop = _serve_in_thread(path, _handler)
    try:
        c = IpcClient(path, timeout_s=5)
        assert c.call("echo", value=b"\x00bytes")["value"] == b"\x00bytes"
        with pytest.raises(RemoteError) as exc:
            c.call("nope")
        assert exc.value.code == "unknown_op"
        assert c.call("echo", value=[1, {"a": 2}])["value"] == [1, {"a": 2}]
        c.close()
    finally:
        stop()
    import os
    import stat

    assert not os.path.exists(path) or stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_async_client_gets_a_fast_reply_past_a_slow_one(tmp_path):
    path = str(tmp_path / "l.sock")
    stop = _serve_in_thread(path, _handler)

    async def body():
        c = AsyncIpcClient(path)
        slow = asyncio.create_task(c.call("slow", s=1.0))
        fast = await asyncio.wait_for(c.call("echo", value=7), 0.9)
        assert fast["value"] == 7
        assert not slow.done()
        assert (await slow)["slow"] is True
        await c.close()
    try:
        asyncio.run(body())
    finally:
        stop()


def test_unreachable_ledger_is_a_clear_error(tmp_path):
    c = IpcClient(str(tmp_path / "missing.sock"))
    with pytest.raises(IpcError, match="not reachable"):
        c.call("echo", value=1)


def test_oversize_and_malformed_frames_close_only_that_connection(tmp_path):
    path = str(tmp_path / "l.sock")
    stop = _serve_in_thread(path, _handler)
    try:
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(path)
        raw.sendall(struct.pack(">I", 1 << 30))
        raw.settimeout(5)
        assert raw.recv(10) == b""  # the server hung up
        raw.close()
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(path)
        raw.sendall(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
        assert raw.recv(10) == b""
        raw.close()
        client = IpcClient(path)
        assert client.call("echo", value=1)["value"] == 1
        client.close()
        assert pack({"a": 1})[:4] == struct.pack(">I", len(pack({"a": 1})) - 4)
    finally:
        stop()
