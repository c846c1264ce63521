"""The C modules' shared-memory layouts, checked against the Python side's.

The offsets, sizes and codes of the lease table and the ready set are written
twice: in Python (shm/leases/protocol.py, shm/ready/layout.py) and in C, once,
in shm/layout.h. Each C module (``shm._atomic``, ``shm._claim``) exports what
it was built with, by the Python names: ``LEASE_LAYOUT`` and ``READY_LAYOUT``,
the constants those two Python modules define, and ``LEASE_STRUCTS`` and
``READY_STRUCTS``, the fields of a struct the Python side has no constant for,
named ``STRUCT.field`` (``RECORD.lease_id``, ``SLOT.count``), their offsets
worked out here from the Python struct's format. A build of another layout must fail
at import, never read the wrong bytes: ``check_leases`` and ``check_ready``
(called by those modules at import) raise ImportError naming every field that
differs.
"""

from __future__ import annotations

import importlib
import re
import struct
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

__all__ = ["MODULES", "check", "check_all", "check_leases", "check_ready", "lease_side",
           "ready_side"]  # fmt: skip

# The C modules that export layouts.
MODULES = ("shm._atomic", "shm._claim")

# The fields of the structs whose offsets the C code uses by name, in order
# (padding bytes, "x", have none): shm/leases/protocol.py's RECORD and KEY_META,
# shm/ready/layout.py's SLOT and ENTRY.
RECORD_FIELDS = (
    "lease_id", "granted_at", "expires_at", "held_until", "lease_s", "cadence_s", "misses",
    "ended", "consumer_len", "error_len", "consumer", "error", "version",
)  # fmt: skip
KEY_META_FIELDS = ("key_len", "reserved", "block")
SLOT_FIELDS = ("seq", "count", "generation", "published_at", "claim_cursor", "heap_used", "flags")
ENTRY_FIELDS = ("key_offset", "key_len", "class_id", "version", "due_minute", "rank")

_ITEM = re.compile(r"(\d*)([xcbB?hHiIlLqQnNefdspP])")


def check(module_name: str, exported: Mapping[str, int], python_globals: Mapping[str, Any]) -> None:
    """ImportError unless every offset and code a C module was compiled with
    (``exported``, by the Python names) is the one the Python side defines:
    the layouts are written in both, and a build of another layout must fail
    at import, never read the wrong bytes."""
    ours = python_globals
    wrong = [f"{name} is {value} there, {ours.get(name)} here"
             for name, value in exported.items() if ours.get(name) != value]  # fmt: skip
    if wrong:
        raise ImportError(
            f"{module_name} was built from another layout ({'; '.join(wrong)}): rebuild it "
            "(pip install -e . or scripts/setup)"
        )


def field_offsets(name: str, layout: struct.Struct, fields: Sequence[str]) -> dict[str, int]:
    """``{"NAME.field": offset}`` for each field of a struct, in order."""
    fmt = layout.format.lstrip("<>=!@")
    offsets: list[int] = []
    at = 0
    for count, code in _ITEM.findall(fmt):
        n = int(count) if count else 1
        size = struct.calcsize(f"<{n}{code}")
        if code == "x":
            pass
        elif code in "sp":
            offsets.append(at)
        else:
            offsets.extend(at + i * (size // n) for i in range(n))
        at += size
    if len(offsets) != len(fields) or at != layout.size:
        raise ImportError(f"shm.layout: {name} {layout.format!r} is not ({', '.join(fields)})")
    return {f"{name}.{field}": off for field, off in zip(fields, offsets, strict=True)}


def lease_side(ns: Mapping[str, Any]) -> dict[str, Any]:
    """shm/leases/protocol.py's names (``ns``: its globals) and what is worked out from
    them, as LEASE_LAYOUT and LEASE_STRUCTS name their fields."""
    record, key_meta = ns["RECORD"], ns["KEY_META"]
    return {
        **ns,
        "RECORD_SIZE": record.size,
        "COPY_AT_0": ns["COPY_AT"][0],
        "COPY_AT_1": ns["COPY_AT"][1],
        **field_offsets("RECORD", record, RECORD_FIELDS),
        **field_offsets("KEY_META", key_meta, KEY_META_FIELDS),
    }


def ready_side(ns: Mapping[str, Any]) -> dict[str, Any]:
    """shm/ready/layout.py's names (``ns``: its globals) and what is worked out from
    them, as READY_LAYOUT and READY_STRUCTS name their fields."""
    return {
        **ns,
        **field_offsets("SLOT", ns["SLOT"], SLOT_FIELDS),
        **field_offsets("ENTRY", ns["ENTRY"], ENTRY_FIELDS),
    }


def built() -> dict[str, ModuleType]:
    """The C modules that are built, by name (the ones already loaded first:
    shm/leases/test_stops.py loads the test build, QUEUE_NODE_TEST_BUILD, under these
    names)."""
    found = {}
    for name in MODULES:
        try:
            found[name] = importlib.import_module(name)
        except ImportError:
            continue  # not built: the Python paths serve, and read no offset from C
    return found


def check_leases(ns: Mapping[str, Any]) -> None:
    """Every built C module's LEASE_LAYOUT against shm/leases/protocol.py (``ns``: its
    globals, once its layout constants are defined)."""
    ours = lease_side(ns)
    for name, module in built().items():
        check(name, {**module.LEASE_LAYOUT, **module.LEASE_STRUCTS}, ours)


def check_ready(ns: Mapping[str, Any]) -> None:
    """Every built C module's READY_LAYOUT against shm/ready/layout.py (``ns``: its
    globals, once its layout constants are defined)."""
    ours = ready_side(ns)
    for name, module in built().items():
        check(name, {**module.READY_LAYOUT, **module.READY_STRUCTS}, ours)


def check_all() -> None:
    """Both layouts of every built C module, against shm.leases and shm.ready."""
    from shm.leases import protocol
    from shm.ready import layout

    check_leases(vars(protocol))
    check_ready(vars(layout))
