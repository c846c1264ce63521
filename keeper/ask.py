"""Questions to the keeper over a POSIX message queue.

Worker 0 never serves HTTP, but a worker sometimes needs the keeper's own view
of a key (``GET /rows?key=`` explains a row), and tests need to dump the
keeper's buckets or start a verification walk. A worker sends a small msgpack
request to ``/queue-node.<name>.ask``; the keeper answers between ticks into
a reply queue made for that one question. A keeper that is stalled or
loading simply does not answer in time, and the asker says so: nothing waits
on it for longer than the timeout.

Limits: every queue counts against the user's RLIMIT_MSGQUEUE (800 KiB by
default, about ten queues of 10 × 8 KiB), so queues are small (4 messages of
8 KiB to ask, 1 to answer) and a reply queue lives only as long as its
question. Requests and replies stay small; bulk answers (a dump) go to a file
in the node's run directory whose path is in the reply (never a path a
request names).

Trust: the ask queue is created exclusively, mode 0600; one a crash of this
user's left is replaced, anyone else's refused. An asker sends only into a
queue its own uid owns, and the keeper answers only into such a reply queue.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import msgpack
import posix_ipc

from node.core.errors import NameTaken, NodeNotRunning
from node.core.names import ask_queue_name, reply_queue_prefix
from shm.segment import check_owner
from shm.wake import Wake

MAX_MESSAGES = 4
# A reply queue holds one answer.
REPLY_MESSAGES = 1
MAX_MESSAGE_BYTES = 8192
_MODE = 0o600


_ids = itertools.count(1)


def _queue_owner(mq: posix_ipc.MessageQueue) -> int:
    # On Linux a message queue descriptor is a file descriptor of the mqueue
    # file system, so fstat tells its owner even where /dev/mqueue is not
    # mounted.
    return os.fstat(mq.mqd).st_uid


def check_queue(name: str) -> None:
    """NameTaken unless queue ``name`` is absent or this uid's own."""
    try:
        mq = posix_ipc.MessageQueue(name, read=False, write=True)
    except posix_ipc.ExistentialError:
        return
    except posix_ipc.PermissionsError:
        raise NameTaken(f"{name} exists and this user cannot even open it: it is "
                        "another user's; remove it as its owner or root, or pick "
                        "another --name") from None
    try:
        check_owner(name, _queue_owner(mq))
    finally:
        mq.close()


class AskServer:
    """The keeper's end. Created by the keeper, unlinked by the supervisor."""

    def __init__(self, node: str) -> None:
        self.node = node
        name = ask_queue_name(node)
        try:
            self._mq = self._create(name)
        except posix_ipc.ExistentialError:
            # One a crash of ours left holds only stale questions: replaced.
            # Anyone else's is refused (the supervisor checked at start too).
            check_queue(name)
            posix_ipc.unlink_message_queue(name)
            self._mq = self._create(name)
        self._mq.block = False

    @staticmethod
    def _create(name: str) -> posix_ipc.MessageQueue:
        return posix_ipc.MessageQueue(
            name,
            posix_ipc.O_CREX,
            mode=_MODE,
            max_messages=MAX_MESSAGES,
            max_message_size=MAX_MESSAGE_BYTES,
            read=True,
            write=False,
        )

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
            reply = request.get("reply") if isinstance(request, dict) else None
            if isinstance(reply, str) and reply.startswith(reply_queue_prefix(self.node)):
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
            mq = posix_ipc.MessageQueue(request["reply"])
        except posix_ipc.ExistentialError:
            return False
        try:
            if _queue_owner(mq) != os.getuid():
                return False  # never answer into another user's queue
            mq.block = False
            mq.send(data)
            return True
        except posix_ipc.BusyError:
            return False
        finally:
            mq.close()

    def close(self) -> None:
        self._mq.close()


def ask(node: str, request: dict[str, Any], timeout_s: float = 1.0) -> dict[str, Any] | None:
    """Ask the keeper of ``node``; None when no keeper answered in time.

    Each question gets a reply queue of its own, unlinked as soon as it is
    answered (or not): queues count against the user's RLIMIT_MSGQUEUE, so
    none may be left open between questions."""
    request_id = next(_ids)
    name = f"{reply_queue_prefix(node)}{os.getpid()}.{request_id}"
    try:
        reply_mq = posix_ipc.MessageQueue(
            name,
            posix_ipc.O_CREX,
            mode=_MODE,
            max_messages=REPLY_MESSAGES,
            max_message_size=MAX_MESSAGE_BYTES,
        )
    except (posix_ipc.Error, OSError):
        return None
    try:
        data = msgpack.packb(dict(request, id=request_id, reply=name), use_bin_type=True)
        try:
            mq = posix_ipc.MessageQueue(ask_queue_name(node))
        except posix_ipc.ExistentialError:
            return None
        try:
            if _queue_owner(mq) != os.getuid():
                return None  # not the keeper's: questions may name keys
            mq.send(data, timeout=timeout_s)
        except posix_ipc.BusyError:
            return None
        finally:
            mq.close()
        _wake_keeper(node)
        try:
            raw, _prio = reply_mq.receive(timeout=timeout_s)
        except posix_ipc.BusyError:
            return None
        reply = msgpack.unpackb(raw, raw=False)
        return reply if isinstance(reply, dict) and reply.get("id") == request_id else None
    finally:
        reply_mq.close()
        try:
            reply_mq.unlink()
        except posix_ipc.ExistentialError:
            pass


def _wake_keeper(node: str) -> None:
    """Post the keeper's wake semaphore: it answers between ticks, and a
    keeper that NOTIFY wakes (PostgreSQL) may otherwise wait longer than
    the asker's timeout. No semaphore (a keeper run without a node): it
    polls the queue anyway."""
    try:
        wake = Wake.attach(node)
    except (NodeNotRunning, NameTaken, OSError):
        return
    try:
        wake.post()
    finally:
        wake.close()


def unlink_all(node: str) -> None:
    """Supervisor only: remove the ask queue and any reply queues left by
    crashed askers."""
    names = [ask_queue_name(node)]
    try:
        prefix = reply_queue_prefix(node).lstrip("/")
        names += ["/" + n for n in os.listdir("/dev/mqueue") if n.startswith(prefix)]
    except OSError:
        pass
    for name in names:
        try:
            posix_ipc.unlink_message_queue(name)
        except posix_ipc.ExistentialError:
            pass
