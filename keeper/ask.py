"""Questions to the keeper over a POSIX message queue.

Worker 0 never serves HTTP, but a worker sometimes needs the keeper's own view
of a key (``GET /rows?key=`` explains a row), and tests need to dump the
keeper's buckets or start a verification walk. A worker sends a small msgpack
request to ``/queue-node.<name>.ask``; the keeper answers between ticks into
the asking process's own reply queue. A keeper that is stalled or loading
simply does not answer in time, and the asker says so: nothing waits on it
for longer than the timeout.

Limits: Linux's defaults for an unprivileged queue are 10 messages of 8 KiB,
so requests and replies stay small; bulk answers (a dump) go to a file whose
path is in the reply.
"""

from __future__ import annotations

import atexit
import itertools
import os
import time
from typing import Any

import msgpack
import posix_ipc

MAX_MESSAGES = 10
MAX_MESSAGE_BYTES = 8192
_MODE = 0o600


def ask_queue_name(node: str) -> str:
    return f"/queue-node.{node}.ask"


def reply_queue_name(node: str, pid: int) -> str:
    return f"/queue-node.{node}.reply.{pid}"


class AskServer:
    """The keeper's end. Created by the keeper, unlinked by the supervisor."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._mq = posix_ipc.MessageQueue(
            ask_queue_name(node),
            posix_ipc.O_CREAT,
            mode=_MODE,
            max_messages=MAX_MESSAGES,
            max_message_size=MAX_MESSAGE_BYTES,
            read=True,
            write=False,
        )
        self._mq.block = False

    def poll(self, limit: int = MAX_MESSAGES) -> list[dict[str, Any]]:
        """Requests waiting now, without blocking. Malformed ones are dropped."""
        out = []
        for _ in range(limit):
            try:
                raw, _prio = self._mq.receive()
            except posix_ipc.BusyError:
                break
            try:
                request = msgpack.unpackb(raw, raw=False)
            except (ValueError, msgpack.ExtraData, msgpack.UnpackException):
                continue
            if isinstance(request, dict) and isinstance(request.get("reply_pid"), int):
                out.append(request)
        return out

    def answer(self, request: dict[str, Any], reply: dict[str, Any]) -> bool:
        """Send ``reply`` to the asker; False when the asker is gone or full."""
        reply = dict(reply, id=request.get("id"))
        data = msgpack.packb(reply, use_bin_type=True)
        if len(data) > MAX_MESSAGE_BYTES:
            data = msgpack.packb(
                {"id": request.get("id"), "error": "reply too large"}, use_bin_type=True
            )
        try:
            mq = posix_ipc.MessageQueue(reply_queue_name(self.node, request["reply_pid"]))
        except posix_ipc.ExistentialError:
            return False
        try:
            mq.block = False
            mq.send(data)
            return True
        except posix_ipc.BusyError:
            return False
        finally:
            mq.close()

    def close(self) -> None:
        self._mq.close()


class _ReplyQueue:
    """One reply queue per asking process, created on first use."""

    def __init__(self, node: str) -> None:
        self.name = reply_queue_name(node, os.getpid())
        self.pid = os.getpid()
        self.mq = posix_ipc.MessageQueue(
            self.name,
            posix_ipc.O_CREAT,
            mode=_MODE,
            max_messages=MAX_MESSAGES,
            max_message_size=MAX_MESSAGE_BYTES,
        )
        atexit.register(self.remove)

    def remove(self) -> None:
        if os.getpid() != self.pid:
            return
        try:
            self.mq.close()
            posix_ipc.unlink_message_queue(self.name)
        except posix_ipc.ExistentialError:
            pass


_replies: dict[str, _ReplyQueue] = {}
_ids = itertools.count(1)


def ask(node: str, request: dict[str, Any], timeout_s: float = 1.0) -> dict[str, Any] | None:
    """Ask the keeper of ``node``; None when no keeper answered in time."""
    rq = _replies.get(node)
    if rq is None or rq.pid != os.getpid():
        rq = _replies[node] = _ReplyQueue(node)
    request_id = next(_ids)
    data = msgpack.packb(dict(request, id=request_id, reply_pid=os.getpid()), use_bin_type=True)
    try:
        mq = posix_ipc.MessageQueue(ask_queue_name(node))
    except posix_ipc.ExistentialError:
        return None
    try:
        mq.send(data, timeout=timeout_s)
    except posix_ipc.BusyError:
        return None
    finally:
        mq.close()
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            raw, _prio = rq.mq.receive(timeout=left)
        except posix_ipc.BusyError:
            return None
        reply = msgpack.unpackb(raw, raw=False)
        if isinstance(reply, dict) and reply.get("id") == request_id:
            return reply
        # An answer to an earlier question that timed out: drop it.


def unlink_all(node: str) -> None:
    """Supervisor only: remove the ask queue and any reply queues left by
    crashed askers."""
    names = [ask_queue_name(node)]
    try:
        prefix = f"queue-node.{node}.reply."
        names += ["/" + n for n in os.listdir("/dev/mqueue") if n.startswith(prefix)]
    except OSError:
        pass
    for name in names:
        try:
            posix_ipc.unlink_message_queue(name)
        except posix_ipc.ExistentialError:
            pass
