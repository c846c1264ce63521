"""Tests only: stopping a lease-table change at a chosen point, and loading
the test build of shm's extensions. Nothing here runs in production.

``QUEUE_NODE_TEST_LEASE_STOP=<point>:<stop|exit|pause>`` asks a process to
stop (SIGSTOP), exit or pause at ``point`` of every change it makes; tests
set it only in the environment of the child processes they start, and it is
read once, at import. The Python paths' points are ``insert``, ``keyed``,
``update`` and ``written``: there they call ``stop``, which is None unless a
stop was asked for, bound at import as a default argument of the few methods
that have points (so that production pays one test of a local per point,
never a call). The C paths stop only in the test build
(``QUEUE_NODE_TEST_BUILD``, below): the production build has no stop
compiled in. The points of a counted publish are in C only, for the Python
paths too (``C_STOP``). Every point: docs/leases.md, "Dying mid-grant".
One point is a claim's, not a change's: ``read``, a claim that has read an
entry's row and found it due, before its grant (both claim paths; the
read-to-grant window of docs/delivery.md).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

# A directory holding the test build of shm's extensions (setup.py with
# QUEUE_NODE_TEST_STOPS=1), loaded instead of the installed ones.
_TEST_BUILD = os.environ.get("QUEUE_NODE_TEST_BUILD", "")
_TEST_STOP = os.environ.get("QUEUE_NODE_TEST_LEASE_STOP", "")


def extension(name: str) -> Any:
    """``shm.<name>``, or its test build from QUEUE_NODE_TEST_BUILD."""
    if not _TEST_BUILD:
        return importlib.import_module(f"shm.{name}")
    import shm

    path = os.path.join(_TEST_BUILD, "shm", name + importlib.machinery.EXTENSION_SUFFIXES[0])
    spec = importlib.util.spec_from_file_location(f"shm.{name}", path)
    if spec is None or spec.loader is None or not os.path.exists(path):
        raise ImportError(f"QUEUE_NODE_TEST_BUILD={_TEST_BUILD}: no {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # workers/claim/path.py's ``from shm import _claim`` must find this one: its
    # ClaimPath takes this module's Granter.
    sys.modules[spec.name] = module
    setattr(shm, name, module)
    return module


def check_build(*modules: Any) -> None:
    """RuntimeError when a stop is asked for and one of ``modules`` (the
    extensions loaded; None for one that is not) was built without stops:
    a stop compiled out would let the test pass without it."""
    if _TEST_STOP and not all(getattr(m, "TEST_STOPS", 1) for m in modules if m is not None):
        raise RuntimeError(
            "QUEUE_NODE_TEST_LEASE_STOP needs the test build of shm's extensions "
            "(QUEUE_NODE_TEST_BUILD; see setup.py)"
        )


# shm/_claim.h P_*: journaled, published and counted are the three kill
# points of a counted publish (before its swap, between its swap and its
# count, before its journal is cleared), in C for every path.
_C_POINTS = {
    "insert": 1,
    "keyed": 2,
    "update": 3,
    "written": 4,
    "published": 5,
    "journaled": 6,
    "counted": 7,
    "read": 8,
}


def _c_stop(spec: str) -> int:
    """The test stop as shm/_claim.h takes it: point | how << 4; 0 for none."""
    where, _, how = spec.partition(":")
    point = _C_POINTS.get(where, 0)
    return point and point | {"exit": 1, "pause": 2}.get(how, 0) << 4


C_STOP = _c_stop(_TEST_STOP)  # handed to every C path (workers/claim/path.py's too); 0: none


def _test_stop(point: str) -> None:
    """Die, stop or pause between taking a slot and publishing it."""
    where, _, how = _TEST_STOP.partition(":")
    if where == point:
        if how == "exit":
            os._exit(17)
        elif how == "pause":
            time.sleep(0.0005)  # widens a race window
        else:
            os.kill(os.getpid(), signal.SIGSTOP)


Stop = Callable[[str], None]

#: What the Python paths call at each point: None in production.
stop: Stop | None = _test_stop if _TEST_STOP else None
