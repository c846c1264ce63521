"""Small process helpers shared by the supervisor and its children."""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)

# Exit codes with names (as dramatiq's RET_*).
RET_OK = 0
RET_ERROR = 1
RET_USAGE = 2
RET_NOT_VOUCHED = 3
RET_NO_NODE = 4

# How a child learns the resolved configuration and its place.
ENV_CONFIG = "QUEUE_NODE_RUN_CONFIG"  # path of the resolved config JSON
ENV_SUPERVISOR = "QUEUE_NODE_SUPERVISOR_PID"
ENV_STARTED_AT = "QUEUE_NODE_STARTED_AT"  # the node's start, wall seconds


class UsageError(Exception):
    """A child process was started with arguments it cannot take."""


class ChildArgParser(argparse.ArgumentParser):
    """argparse for a child process: a bad argument raises UsageError (the
    child prints one line and exits RET_USAGE) instead of exiting in argparse."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog=prog, add_help=False)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def die_with_parent(expected_parent: int | None = None) -> None:
    """Make the kernel SIGKILL this process when its parent dies.

    PR_SET_PDEATHSIG fires when the thread that forked us exits; the
    supervisor is single-threaded, so that is the supervisor itself. If the
    parent died before we got here we were re-parented already: exit now,
    never live on as a second keeper.
    """
    if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    parent = expected_parent or int(os.environ.get(ENV_SUPERVISOR, "0") or 0)
    if parent and os.getppid() != parent:
        os._exit(RET_ERROR)


def child_signals() -> None:
    """Children ignore Ctrl-C (the supervisor drains them) and take SIGTERM
    as "stop": the default action, unless the child installs its own flag."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def set_title(title: str) -> None:
    """Best effort: name the process for ps/top (no setproctitle dependency)."""
    try:
        _libc.prctl(15, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


def python_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def unblock_all() -> None:
    """A child's ``preexec_fn``: it starts with no signal blocked."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def drain_pipe(fd: int) -> None:
    """Read a non-blocking pipe (a signal wake-up fd) until it is empty."""
    while True:
        try:
            if not os.read(fd, 512):
                return
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return
            raise
