"""The keeper's wake semaphore: a write through the node nudges the keeper.

A POSIX named semaphore, ``/queue-node.<name>.wake``, mode 0600. Any process
may ``post``; only the keeper waits. A post is a hint ("something changed,
look now"), not a count of changes, so its value is capped: a burst of writes
while the keeper is busy (or gone) costs it one extra loop, not thousands.

Only the supervisor creates and unlinks it; everyone else closes.
"""

from __future__ import annotations

import os
import stat

import posix_ipc

from node.core.errors import NameTaken, NodeNotRunning
from node.core.names import wake_name
from shm.segment import check_owner

# A post while the value is already this high is dropped: the keeper will wake
# anyway, and the value must not grow without bound while nobody waits.
WAKE_CAP = 2


def semaphore_owner(name: str) -> int:
    """The uid that owns named semaphore ``name``: glibc keeps it as the file
    ``/dev/shm/sem.<name>`` (not followed if it is a link). -1 when there is
    none; -2 when the name is not a plain file (a link another user planted
    is nobody's semaphore: refused)."""
    try:
        st = os.lstat(f"/dev/shm/sem.{name.lstrip('/')}")
    except FileNotFoundError:
        return -1
    except OSError:
        return -2
    return st.st_uid if stat.S_ISREG(st.st_mode) else -2


def check_semaphore(name: str, owner: int, absent_ok: bool = False) -> None:
    """NameTaken unless the semaphore is this uid's (or absent, when that is
    all right)."""
    if owner == -1 and absent_ok:
        return
    if owner < 0:
        raise NameTaken(
            f"/dev/shm/sem.{name.lstrip('/')} is not a plain file (a link?): it is not "
            "this node's semaphore; remove it as its owner or root, or pick another --name"
        )
    check_owner(name, owner)


class Wake:
    def __init__(self, node: str, sem: posix_ipc.Semaphore) -> None:
        self.node = node
        self.sem = sem
        self._closed = False

    @classmethod
    def create(cls, node: str) -> Wake:
        """Supervisor: create the semaphore, or reuse (and drain) one a crash left."""
        name = wake_name(node)
        try:
            # The umask can only narrow 0600, never widen it.
            sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
        except posix_ipc.ExistentialError:
            try:
                sem = posix_ipc.Semaphore(name)
            except OSError as exc:  # ELOOP: a link in its place
                raise NameTaken(f"{name}: {exc}; not this node's semaphore") from None
            try:
                check_semaphore(name, semaphore_owner(name))
            except BaseException:
                sem.close()
                raise
        wake = cls(node, sem)
        wake.drain()
        return wake

    @classmethod
    def attach(cls, node: str) -> Wake:
        name = wake_name(node)
        try:
            sem = posix_ipc.Semaphore(name)
        except posix_ipc.ExistentialError:
            raise NodeNotRunning(
                f"{name} does not exist: no node named {node!r} runs on this host"
            ) from None
        try:
            check_semaphore(name, semaphore_owner(name))
        except BaseException:
            sem.close()
            raise
        return cls(node, sem)

    def post(self) -> None:
        """Nudge the keeper. Never blocks; a no-op while a nudge is already pending.

        The semaphore outlives the keeper, so posting while it is gone is fine:
        the next keeper drains it at start.
        """
        if self.sem.value < WAKE_CAP:
            self.sem.release()

    def wait(self, timeout_s: float | None) -> bool:
        """Keeper: sleep until posted or ``timeout_s``; True when posted.

        A signal ends the wait early (False) so the caller can look at its flags.
        """
        try:
            self.sem.acquire(timeout_s)
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return False
        return True

    def drain(self) -> int:
        """Take every pending post without blocking; how many there were."""
        taken = 0
        while True:
            try:
                self.sem.acquire(0)
            except posix_ipc.BusyError:
                return taken
            taken += 1

    def close(self) -> None:
        """Close this process's handle (idempotent). Never unlinks."""
        if not self._closed:
            self._closed = True
            self.sem.close()

    @staticmethod
    def unlink(node: str) -> bool:
        """Supervisor only. False when it did not exist."""
        try:
            posix_ipc.unlink_semaphore(wake_name(node))
        except posix_ipc.ExistentialError:
            return False
        return True

    def __enter__(self) -> Wake:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
