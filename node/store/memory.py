"""The in-memory twin of the SQLite store, for fast unit tests.

Same semantics as ``node.store.sqlite``, down to the details that tests can
see: versions are the seq of the change that made them, seqs start at 1 and
have no gaps, payloads are stored as JSON text (a read returns a fresh copy),
values are coerced the way SQLite's column affinities coerce them, a NULL in
a NOT NULL column fails the whole batch with ``StoreError``, and a no-op
update is still logged. ``tests/integration/test_store.py`` holds the two together.

Nothing here crosses processes: a forked child gets a private copy.
"""

from __future__ import annotations

import bisect
import json
import math
import time
from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import Any

from sortedcontainers import SortedDict  # type: ignore[import-untyped]

from node.core.errors import StoreError
from node.core.rows import (
    DEFAULT_JOB,
    OP_DELETE,
    OP_INSERT,
    OP_UPDATE,
    ORIGIN_NODE,
    ORIGIN_WRITEBACK,
    ORIGINS,
    Change,
    Row,
    RowWrite,
    stored_row_is_valid,
)
from node.store.base import (
    BadRow,
    DueChange,
    LastError,
    Store,
    WriteBack,
    due_now_query,
    due_or_none,
)

# Positions in a stored row (a list, so an update can assign in place).
_ROUTE, _CADENCE, _SITEMAP, _DUE, _PAYLOAD, _JOB, _VERSION = range(7)
# The outcome of the row's last lease (not logged; not in a change).
_RESULT_ID, _FINISHED, _ERROR = range(7, 10)
_FIELD_INDEX = {
    "cadence_s": _CADENCE,
    "sitemap": _SITEMAP,
    "due_at": _DUE,
    "payload": _PAYLOAD,
    "job": _JOB,
}
_NOT_NULL = ("route", "sitemap", "due_at", "job")
_seq_of = attrgetter("seq")


def _integer(value: Any) -> Any:
    """INTEGER affinity: a bool or an integral float is stored as an int."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _real(value: Any) -> Any:
    """REAL affinity: an int (or bool) is stored as a float."""
    if isinstance(value, bool | int):
        return float(value)
    return value


def _stored_fields(w: RowWrite) -> dict[str, Any]:
    """The fields a write carries, as SQLite would store them; raises
    StoreError where SQLite would refuse the batch (NULL in NOT NULL)."""
    fields: dict[str, Any] = {"route": w.route}
    for name in w.present():
        fields[name] = getattr(w, name)
    for name in _NOT_NULL:
        value = fields.get(name, 0)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            raise StoreError(f"memory store: upsert: NOT NULL constraint failed: schedule.{name}")
    if "cadence_s" in fields:
        fields["cadence_s"] = _integer(fields["cadence_s"])
    if "sitemap" in fields:
        fields["sitemap"] = _integer(fields["sitemap"])
    if "due_at" in fields:
        fields["due_at"] = _real(fields["due_at"])
    if "payload" in fields:
        payload = fields["payload"]
        fields["payload"] = (
            None if payload is None else json.dumps(payload, separators=(",", ":"), allow_nan=False)
        )
    return fields


def _decode_payload(stored: str | None) -> Any:
    return None if stored is None else json.loads(stored)


def _row(key: str, stored: list) -> Row | BadRow:
    route, cadence_s, sitemap, due_at, payload, job, version, rid, finished, error = stored
    if not stored_row_is_valid(route, cadence_s, sitemap, due_at):
        return BadRow(
            key,
            version,
            "stored values are not schedulable: "
            f"route={route!r} cadence_s={cadence_s!r} sitemap={sitemap!r} due_at={due_at!r}",
        )
    return Row(
        key, route, cadence_s, sitemap == 1, due_at, _decode_payload(payload), job, version,
        rid, finished, error,
    )  # fmt: skip


class MemoryStore(Store):
    """The schedule in dicts, the change log in a list."""

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._rows: SortedDict = SortedDict()  # key -> [route, cadence_s, ..., version]
        self._changes: list[Change] = []  # in seq order
        self._old_due: dict[int, Any] = {}  # seq -> the due time the change replaced
        self._seq = 0
        self._meta: dict[str, str] = {}  # JSON text, so reads return copies
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("memory store: the store is closed")

    def _log(self, op: str, key: str, origin: str, stored: list | None, old_due: Any = None) -> int:
        self._seq += 1
        at = time.time()
        self._old_due[self._seq] = old_due
        if stored is None:
            change = Change(self._seq, op, key, origin, None, None, False, None, at)
        elif stored_row_is_valid(*stored[_ROUTE : _DUE + 1]):
            route, cadence_s, sitemap, due_at = stored[_ROUTE : _DUE + 1]
            change = Change(self._seq, op, key, origin, route, cadence_s, sitemap == 1, due_at, at)
        else:
            change = Change(self._seq, op, key, origin, None, None, False, None, at, False)
        self._changes.append(change)
        return self._seq

    # -- writes ----------------------------------------------------------------

    def upsert(self, rows: Sequence[RowWrite], *, now: float, origin: str = ORIGIN_NODE) -> int:
        """Insert or update rows as one batch; returns ``len(rows)``. A later
        write of a key in the batch wins; a no-op update is still logged."""
        self._check_open()
        _check_origin(origin)
        # Everything that can fail is checked before anything changes, so a
        # failed batch leaves no trace (as the SQLite transaction would).
        writes = [(w.key, _stored_fields(w)) for w in rows]
        for key, fields in writes:
            stored = self._rows.get(key)
            if stored is None:
                stored = [
                    fields["route"],
                    fields.get("cadence_s"),
                    fields.get("sitemap", 0),
                    fields.get("due_at", _real(now)),
                    fields.get("payload"),
                    fields.get("job", DEFAULT_JOB),
                    0,
                    None,
                    None,
                    None,
                ]
                self._rows[key] = stored
                op = OP_INSERT
                old_due = None
            else:
                old_due = stored[_DUE]
                stored[_ROUTE] = fields.pop("route")
                for name, value in fields.items():
                    stored[_FIELD_INDEX[name]] = value
                op = OP_UPDATE
            stored[_VERSION] = self._log(op, key, origin, stored, old_due)
        return len(rows)

    def delete(self, keys: Sequence[str], *, origin: str = ORIGIN_NODE) -> int:
        self._check_open()
        _check_origin(origin)
        deleted = 0
        for key in keys:
            if (gone := self._rows.pop(key, None)) is not None:
                self._log(OP_DELETE, key, origin, None, gone[_DUE])
                deleted += 1
        return deleted

    def due_now(
        self, *, route: str | None = None, job: str | None = None, now: float,
        origin: str = ORIGIN_NODE,
    ) -> int:  # fmt: skip
        self._check_open()
        _check_origin(origin)
        due_now_query(route, job, "", "")  # the same argument check
        field, value = (_ROUTE, route) if route is not None else (_JOB, job)
        n = 0
        for key, stored in self._rows.items():
            if stored[field] != value:
                continue
            old_due = stored[_DUE]
            # As SQLite's MIN: a due time that is not a number sorts after any.
            number = isinstance(old_due, int | float) and not isinstance(old_due, bool)
            stored[_DUE] = _real(min(old_due, now) if number else now)
            stored[_VERSION] = self._log(OP_UPDATE, key, origin, stored, old_due)
            n += 1
        return n

    def write_next_due(self, key: str, due_at: float, *, if_version: int) -> int | None:
        self._check_open()
        stored = self._rows.get(key)
        if stored is None or stored[_VERSION] != if_version:
            return None
        if due_at is None or math.isnan(due_at):
            raise StoreError("memory store: write_next_due: NOT NULL constraint failed")
        old_due = stored[_DUE]
        stored[_DUE] = _real(due_at)
        stored[_VERSION] = self._log(OP_UPDATE, key, ORIGIN_WRITEBACK, stored, old_due)
        return stored[_VERSION]

    def write_back_many(self, items: Sequence[WriteBack]) -> list[int | None]:
        self._check_open()
        for it in items:  # what SQLite would refuse, before anything changes
            if it.due_at is None or math.isnan(it.due_at):
                raise StoreError("memory store: write_back_many: NOT NULL constraint failed")
        out: list[int | None] = []
        for it in items:
            stored = self._rows.get(it.key)
            if stored is None or stored[_VERSION] != it.if_version:
                out.append(None)
                continue
            old_due = stored[_DUE]
            stored[_DUE] = _real(it.due_at)
            stored[_RESULT_ID] = _integer(it.result_id)
            stored[_FINISHED] = _real(it.finished_at)
            stored[_ERROR] = None
            stored[_VERSION] = self._log(OP_UPDATE, it.key, ORIGIN_WRITEBACK, stored, old_due)
            out.append(stored[_VERSION])
        return out

    def write_last_errors(self, items: Sequence[LastError]) -> int:
        self._check_open()
        n = 0
        for it in items:
            stored = self._rows.get(it.key)
            if stored is None:
                continue
            if stored[_FINISHED] is None or stored[_FINISHED] <= it.at:
                stored[_ERROR] = it.error
                n += 1
        return n

    # -- reads -----------------------------------------------------------------

    def get(self, key: str) -> Row | BadRow | None:
        """Point read: the Row, a BadRow for unschedulable values, or None."""
        self._check_open()
        stored = self._rows.get(key)
        return None if stored is None else _row(key, stored)

    def get_many(self, keys: Iterable[str]) -> dict[str, Row | BadRow]:
        """Row or BadRow (as ``get``) by key; keys with no row are absent."""
        self._check_open()
        found: dict[str, Row | BadRow] = {}
        for key in keys:
            stored = self._rows.get(key)
            if stored is not None:
                found[key] = _row(key, stored)
        return found

    def walk(self, after: str | None, limit: int) -> list[Row | BadRow]:
        self._check_open()
        if limit <= 0:
            return []
        start = 0 if after is None else self._rows.bisect_right(after)
        keys = self._rows.keys()[start : start + limit]
        return [_row(key, self._rows[key]) for key in keys]

    def count(self) -> int:
        self._check_open()
        return len(self._rows)

    # -- change log ------------------------------------------------------------

    def changes(self, after_seq: int, limit: int) -> list[Change]:
        self._check_open()
        if limit <= 0:
            return []
        start = bisect.bisect_right(self._changes, after_seq, key=_seq_of)
        return self._changes[start : start + limit]

    def last_seq(self) -> int:
        self._check_open()
        return self._seq

    def trim_changes(self, through_seq: int) -> int:
        self._check_open()
        end = bisect.bisect_right(self._changes, through_seq, key=_seq_of)
        for change in self._changes[:end]:
            self._old_due.pop(change.seq, None)
        del self._changes[:end]
        return end

    def due_history(self, after_seq: int, through_seq: int, limit: int) -> list[DueChange]:
        self._check_open()
        out = []
        for ch in self.changes(after_seq, limit):
            if ch.seq > through_seq:
                break
            out.append(
                DueChange(
                    ch.seq,
                    ch.op,
                    ch.key,
                    ch.origin,
                    due_or_none(ch.due_at),
                    due_or_none(self._old_due.get(ch.seq)),
                    ch.at,
                )
            )
        return out

    # -- meta ------------------------------------------------------------------

    def get_meta(self, name: str, default: Any = None) -> Any:
        self._check_open()
        encoded = self._meta.get(name)
        return default if encoded is None else json.loads(encoded)

    def set_meta(self, name: str, value: Any) -> None:
        self._check_open()
        self._meta[name] = json.dumps(value, separators=(",", ":"), allow_nan=False)

    # -- lifecycle -------------------------------------------------------------

    def reopen(self) -> MemoryStore:
        self._closed = False  # the dicts are the store: nothing to reconnect
        return self

    def close(self) -> None:
        self._closed = True


def _check_origin(origin: str) -> None:
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {ORIGINS}, not {origin!r}")
