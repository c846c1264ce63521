"""Who holds a node's host-wide names, and clearing stale ones.

The names themselves are computed in ``node/core/names.py`` (pure strings);
this module looks them up on the host, so it may import shm and the keeper.
A node named N owns, on its host:

| name | kind | made by |
|---|---|---|
| ``/queue-node.N.ready``, ``.leases``, ``.state`` | shared memory (``/dev/shm``) | supervisor |
| ``/queue-node.N.wake`` | semaphore (``/dev/shm/sem.…``) | supervisor |
| ``/queue-node.N.ask``, ``.reply.*`` | message queues | keeper, askers |
| ``\\0queue-node.N.ledger`` | abstract UNIX socket | ledger |
| ``\\0queue-node.N.rows`` | abstract UNIX socket (a node on PostgreSQL) | row service |

The supervisor checks every one before it creates anything (``check_all``):
a name another user holds, or a segment without this data directory's
identity, or of another layout, is refused with one line (exit 2) and
nothing is created, reused or removed. ``python -m node clear N`` is the
operator's way out: it removes N's names when no process holds them.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import posix_ipc

from node.core.errors import NameTaken, NodeError
from node.core.names import (
    SEGMENT_KINDS,
    ask_queue_name,
    ledger_address,
    owner_name,
    reply_queue_prefix,
    rows_address,
    shm_segment_name,
    wake_name,
)
from shm.segment import pid_alive

# ledger_address is the core's (node/core/names.py), re-exported here.
__all__ = ["SEGMENT_KINDS", "NamesHeld", "check_all", "clear", "holders", "ledger_address"]


class NamesHeld(NodeError):
    """``clear`` found live processes still holding the node's names."""


def check_all(node: str, data_dir_id: bytes, layouts: dict[str, int]) -> None:
    """Refuse (NameTaken, StaleLayout) unless every name of ``node`` is absent
    or this data directory's node's; changes nothing. ``layouts``: kind ->
    the layout version this build writes."""
    from keeper.ask import check_queue
    from shm import segment
    from shm.wake import check_semaphore, semaphore_owner

    for kind in SEGMENT_KINDS:
        segment.vet(shm_segment_name(node, kind), layouts[kind], data_dir_id)
    wake = wake_name(node)
    check_semaphore(wake, semaphore_owner(wake), absent_ok=True)
    check_queue(ask_queue_name(node))
    check_ledger_name(node)
    check_ledger_name(node, rows_address(node), "row service")


def check_ledger_name(node: str, address: str | None = None, what: str = "ledger") -> None:
    """NameTaken when another user's process listens on the ledger's name
    (or on ``address``, the row service's, whose ``what`` it names).

    One of this uid's is a ledger left running (the second-node check
    refuses a live node before this) and is let be: it exits with its
    supervisor."""
    address = address or ledger_address(node)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    try:
        sock.connect(address)
    except OSError:
        return  # nobody listens: the ledger will bind it
    try:
        from node.ipc import peer_uid

        pid, uid = peer_uid(sock)
    finally:
        sock.close()
    if uid != os.getuid():
        raise NameTaken(
            f"the {what} socket @{address[1:]} is bound by pid {pid} of "
            f"{owner_name(uid)}, not this node's user ({owner_name(os.getuid())}): refusing "
            "to start; stop that process or pick another --name"
        )


def _present(node: str) -> list[tuple[str, str]]:
    """``(name, path in /dev/shm or "")`` for each of the node's names that exists."""
    found = []
    for kind in SEGMENT_KINDS:
        name = shm_segment_name(node, kind)
        path = f"/dev/shm{name}"
        if os.path.exists(path):
            found.append((name, path))
    wake = wake_name(node)
    if os.path.exists(f"/dev/shm/sem.{wake.lstrip('/')}"):
        found.append((wake, f"/dev/shm/sem.{wake.lstrip('/')}"))
    ask = ask_queue_name(node)
    try:
        posix_ipc.MessageQueue(ask, read=False, write=True).close()
    except posix_ipc.ExistentialError:
        pass
    except posix_ipc.PermissionsError:
        found.append((ask, ""))
    else:
        found.append((ask, ""))
    return found


def holders(node: str) -> dict[int, list[str]]:
    """pid -> the names of ``node`` it maps or has open, from /proc (every
    process when root, this user's otherwise)."""
    present = _present(node)
    paths = {path for _name, path in present if path}
    queues = {name for name, path in present if not path}
    replies = reply_queue_prefix(node)
    held: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        names: set[str] = set()
        try:
            with open(entry / "maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    path = line.rstrip("\n").split(None, 5)[-1]
                    if path.removesuffix(" (deleted)") in paths:
                        names.add(path.removesuffix(" (deleted)"))
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target in queues or target.startswith(replies):
                    names.add(target)
        except OSError:
            continue
        if names:
            held[pid] = sorted(names)
    return held


def clear(node: str) -> list[str]:
    """Remove ``node``'s names; what was removed. NamesHeld when a live
    process still maps or opens any of them (stop it first); NodeError when
    one is another user's and this user may not remove it."""
    from keeper.ask import unlink_all
    from shm import segment
    from shm.state import StateBuffer

    held = holders(node)
    try:
        with StateBuffer.attach(node, read_only=True) as state:
            owner = state.segment.owner_pid
    except NodeError:
        owner = 0
    if owner and owner not in held and pid_alive(owner):
        held[owner] = [shm_segment_name(node, "state") + " (its supervisor)"]
    if held:
        said = "; ".join(f"pid {pid}: {', '.join(names)}" for pid, names in sorted(held.items()))
        raise NamesHeld(f"node {node!r} is still in use ({said}): stop it first")
    removed = []
    for name, path in _present(node):
        try:
            if path.startswith("/dev/shm/sem."):
                posix_ipc.unlink_semaphore(name)
            elif path:
                segment.unlink(name)
            else:
                unlink_all(node)
        except (posix_ipc.PermissionsError, PermissionError) as exc:
            raise NodeError(
                f"cannot remove {name}: {exc}; it is another user's: run clear as its owner or root"
            ) from None
        removed.append(name)
    return removed
