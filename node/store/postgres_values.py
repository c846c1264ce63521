"""The PostgreSQL store's rows as its statements take them
(node/store/postgres.py): an upsert's seven arrays, checked before anything
is sent (a refused batch writes nothing), cut into runs of distinct keys,
and the checks of an origin, an integer column and a due time."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from node.core.errors import StoreError
from node.core.rows import DEFAULT_JOB, MISSING, ORIGINS, RowWrite
from node.store.values import encode_payload

# Rows per multi-row upsert statement (seven arrays of this length).
UPSERT_CHUNK = 5_000


def check_origin(origin: str) -> None:
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {ORIGINS}, not {origin!r}")


def _integer(value: Any, name: str) -> Any:
    """An INTEGER column's value as SQLite would keep it schedulable: a bool or
    an integral float as an int; anything else non-integral is refused."""
    if value is None or isinstance(value, int):
        return None if value is None else int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise StoreError(f"PostgreSQL store: upsert: {name} must be an integer, not {value!r}")


def due_value(value: Any, action: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise StoreError(f"PostgreSQL store: {action}: due_at must be a number, not {value!r}")
    return float(value)


def columns(rows: Sequence[RowWrite], now: float) -> list[list[Any]]:
    """The seven arrays of one upsert statement, checked before anything is
    sent (a refused batch writes nothing)."""
    cols: list[list[Any]] = [[], [], [], [], [], [], []]
    for w in rows:
        cols[0].append(w.key)
        cols[1].append(w.route)
        cols[2].append(None if w.cadence_s is MISSING else _integer(w.cadence_s, "cadence_s"))
        cols[3].append(0 if w.sitemap is MISSING else _integer(w.sitemap, "sitemap"))
        cols[4].append(now if w.due_at is MISSING else w.due_at)
        cols[5].append(None if w.payload is MISSING else encode_payload(w.payload))
        cols[6].append(DEFAULT_JOB if w.job is MISSING else w.job)
    for due_at in cols[4]:
        if due_at is not None:
            due_value(due_at, "upsert")
    return cols


def distinct_runs(rows: list[RowWrite]) -> Iterator[list[RowWrite]]:
    """``rows`` cut, in order, into runs of distinct keys (one statement may
    not write a key twice)."""
    run: list[RowWrite] = []
    seen: set[str] = set()
    for w in rows:
        if w.key in seen or len(run) >= UPSERT_CHUNK:
            yield run
            run, seen = [], set()
        run.append(w)
        seen.add(w.key)
    if run:
        yield run
