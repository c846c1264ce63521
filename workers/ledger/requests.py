"""The checks of the ledger's requests: what ``complete``, ``poll`` and
``ack`` take, and the error each bad field is answered with (``bad_request``,
one line naming the field). Every check is over the request alone, before
anything is written (``workers/ledger/process.py`` serves the ops)."""

from __future__ import annotations

from typing import Any

from node.completion.base import MAX_RECORD_BYTES
from node.ipc import RemoteError

# Request limits, as the HTTP contract's: items per complete, ids per ack,
# max per poll, wait_s.
MAX_ITEMS = 10_000
MAX_WAIT_S = 60.0
ENCODINGS = ("json", "bytes")
# A key of at most this many characters is at most 1,024 bytes in UTF-8.
_SHORT_KEY = 1024 // 4
# The lean pass's bound on a result and its key together (the record's head
# and meta fit in the rest).
_LIMIT = MAX_RECORD_BYTES - 512

_plain_items_c: Any
try:  # built by setup.py, optional: _plain_items_py is the same pass
    from node.completion.segments._records import plain_items as _plain_items_c
except ImportError:  # pragma: no cover - a build without the extension
    _plain_items_c = None


def bad(message: str) -> RemoteError:
    return RemoteError("bad_request", message)


def check_items(items: Any) -> list[dict]:
    """A complete request is taken whole or refused whole (nothing written).
    The usual request (maps of a short str key, an int lease id, bytes, a
    known encoding) passes one lean pass; anything else is told exactly by
    the field-by-field pass (``_refuse``)."""
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_ITEMS:
        raise bad(f"items must be a list of 1 to {MAX_ITEMS} completions")
    if _plain_items_c is not None:
        return items if _plain_items_c(items, _SHORT_KEY, _LIMIT) else _refuse(items)
    return _plain_items_py(items)


def _plain_items_py(items: list) -> list[dict]:
    """The lean pass in Python: the reference of ``_records.c``'s ``plain_items``."""
    limit = _LIMIT
    for item in items:
        if item.__class__ is not dict:
            return _refuse(items)
        key, lease_id, result = item.get("key"), item.get("lease_id"), item.get("result")
        encoding = item.get("encoding")
        if (
            key.__class__ is not str
            or not 0 < len(key) <= _SHORT_KEY
            or lease_id.__class__ is not int
            or lease_id <= 0
            or result.__class__ is not bytes
            or len(result) + len(key) > limit
            or (encoding != "json" and encoding != "bytes")  # noqa: PLR1714 - no tuple built
        ):
            return _refuse(items)
    return items


def _refuse(items: list) -> list[dict]:
    """Each item field by field: raises for the first bad one; passes an
    item the lean pass did not (a long key, an int subclass, no encoding)."""
    for n, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad(f"items[{n}] must be a map")
        key, lease_id, result = item.get("key"), item.get("lease_id"), item.get("result")
        if not isinstance(key, str) or not key or len(key.encode()) > 1024:
            raise bad(f"items[{n}].key must be a string of 1 to 1024 bytes")
        if not isinstance(lease_id, int) or isinstance(lease_id, bool) or lease_id <= 0:
            raise bad(f"items[{n}].lease_id must be a positive integer")
        if not isinstance(result, bytes):
            raise bad(f"items[{n}].result must be bytes (JSON text or raw)")
        item.setdefault("encoding", "json")
        if item["encoding"] not in ENCODINGS:
            raise bad(f"items[{n}].encoding must be one of {', '.join(ENCODINGS)}")
        if len(result) + len(key) + 512 > MAX_RECORD_BYTES:
            raise RemoteError("result_too_large", f"items[{n}]: a result is at most 16 MiB")
    return items


def job_or_none(job: Any) -> str | None:
    if job is None or (isinstance(job, str) and 0 < len(job) <= 128):
        return job
    raise bad("job must be a string of 1 to 128 characters, or absent for every job")


def int_in(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(f"{name} must be an integer from {low} to {high}")
    return value


def num_in(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise bad(f"{name} must be a number from {low:g} to {high:g}")
    return float(value)
