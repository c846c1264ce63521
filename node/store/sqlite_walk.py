"""The keeper's load walk of a SQLite schedule, read in C (``shm._claim.Walker``).

``SQLiteStore.walk_schedule`` asks this first. The walker reads the same
statement without the validity expression, checks each row's types and
ranges itself and makes a Python object a column only where it must (a route
or cadence that repeats is handed out again): at 250,000 rows a third of the
keeper's load (docs/performance.md, "Exec to live, round 3"). A chunk with a
row it does not read (unschedulable, or not as the node writes rows), a
failed step, or no built extension: ``walk`` answers None and the store reads
the chunk with its SQL, answering or raising exactly as it always did.

The walker holds a connection of its own to the file, through the SQLite
library Python's ``sqlite3`` loaded (never a second copy of SQLite, which
would not see the first one's locks: docs/schema.md), from a walk's first
chunk to its last: a finished walk closes it.
"""

from __future__ import annotations

import os
from typing import Any

from node.core import log
from node.core.rows import MAX_CADENCE_S, MAX_DUE_AT, MIN_CADENCE_S, MIN_DUE_AT
from node.store import queries as q

# Walkers of a store inherited across a fork: never closed in the child.
_INHERITED: list[Any] = []


class FastWalk:
    """One store's C walk: ``walk(after, limit)`` -> ``(rows, last)`` or None."""

    def __init__(self, path: str, busy_timeout_ms: int) -> None:
        self.path = path
        self.busy_timeout_ms = busy_timeout_ms
        self._walker: Any = None
        self._pid = os.getpid()
        self.off: str | None = None  # why the store reads every chunk itself

    def walk(self, after: str | None, limit: int) -> tuple[list[tuple], str | None] | None:
        """The chunk after ``after`` as ``walk_schedule``'s rows and last key
        (its bad rows none), or None: read it with the SQL."""
        if self.off is not None or limit <= 0 or not isinstance(after, str | None):
            return None  # (after a key another program stored as a blob or a number)
        if self._walker is None and not self._open():
            return None
        rows, last = self._walker.walk(after, limit)
        if rows is None:
            return None
        if last is None:
            self.close()  # the walk is done: no connection held until the next
        return rows, last

    def _open(self) -> bool:
        try:
            import _sqlite3  # the module whose SQLite library the walker must share

            from shm import _claim  # type: ignore[attr-defined]
        except ImportError as exc:
            self.off = f"not built: {exc}"
            return False
        try:
            self._walker = _claim.Walker(
                getattr(_sqlite3, "__file__", None),
                self.path,
                self.busy_timeout_ms,
                (MIN_CADENCE_S, MAX_CADENCE_S, MIN_DUE_AT, MAX_DUE_AT),
                q.FAST_WALK_ALL,
                q.FAST_WALK_AFTER,
            )
        except ImportError as exc:  # SQLite's functions not found in _sqlite3
            self.off = str(exc)
            return False
        except _claim.RowError as exc:
            # A file it cannot open now (gone, locked past the timeout): the
            # SQL's read of the chunk says what is wrong; the next chunk tries again.
            log.warn("fast_walk_unavailable", path=self.path, error=str(exc))
            return False
        return True

    def close(self) -> None:
        walker, self._walker = self._walker, None
        if walker is None:
            return
        if self._pid != os.getpid():
            _INHERITED.append(walker)  # the parent's connection: left to the parent
            return
        walker.close()
