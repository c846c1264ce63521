"""The row service of a node on PostgreSQL, and its client.

On SQLite every claimer reads its rows itself (the claim path in C opens the
schedule file). On PostgreSQL that would cost a server connection per
claiming process: each HTTP worker's two claimers and every GPU process's
``LocalClaimer``, and a fleet's connection budget against
``max_connections`` grows with its GPUs (``docs/postgres.md``,
"Connections"). So a node on PostgreSQL runs one more process, the row
service (``workers/rows/service.py``), which holds the node's pool for the
claim path, and every claimer reads a batch's rows through it: one request
over a UNIX socket, one ``SELECT … WHERE key = ANY($1)`` there.

``RowsClient`` is what the claim path (``workers.claim.Claimer``) reads
through then, in place of a store: ``raw_rows`` for the claim path in C (the
rows as sent, checked there: ``shm/_claim_rows.c``), ``get`` and
``get_many`` for the Python path (decoded here by the store's own
``stored_row``), and ``claim_source()`` None (the C path opens no file). It
answers what the store would, row for row, so the claim's checks (gone,
version moved, not due) are the same. When the
service cannot be reached (stopped, restarting after a crash) or its pool
cannot reach the server, a read raises ``StoreUnavailable``, as the store
would: ``LocalClaimer`` answers it ``ClientError(503, "store_unavailable")``,
an HTTP worker 503 ``store_unavailable``. The next read connects again.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from node.core.errors import StoreError, StoreUnavailable
from node.core.names import rows_address
from node.core.rows import Row
from node.ipc import IpcClient, IpcError, RemoteError
from node.store.base import BadRow, ClaimSource
from node.store.values import stored_row

# How long a read waits for the service's answer. The service waits at most
# CONNECT_TIMEOUT_S (5 s) for a pooled connection, so an answer that takes
# longer means the service is stuck (stopped with SIGSTOP, say): the claim
# fails rather than holding its GPU process for the ledger client's 30 s.
CALL_TIMEOUT_S = 10.0
# The least a read bounded by the grant deadline is given (a deadline about
# to pass: the claim's checks refuse it after the read anyway).
MIN_CALL_S = 0.01
# The outcome columns stored_row expects after the eight the service sends.
_NO_OUTCOME = (None, None, None)


class RowsClient:
    """Reads rows for the claim path through node ``name``'s row service.

    One per thread, as a store object is (a blocking socket, one request at a
    time). Holds no PostgreSQL connection. A process that forks may keep
    using it: the socket is reopened in the child."""

    def __init__(self, name: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.name = name
        self.url = f"the row service of node {name!r}"  # as a store's url, for messages
        self._ipc = IpcClient(rows_address(name), timeout_s, peer="the row service")

    def claim_source(self) -> ClaimSource | None:
        return None  # no file for the C path to open: its rows come from raw_rows

    def get(self, key: str) -> Row | BadRow | None:
        return self.get_many([key]).get(key)

    def get_many(self, keys: Iterable[str]) -> dict[str, Row | BadRow]:
        return self._rows(keys, None)

    def get_many_until(self, keys: list[str], until_ns: int) -> dict[str, Row | BadRow]:
        """``get_many``, given up (``StoreUnavailable``) at ``until_ns``
        (CLOCK_MONOTONIC), the claim's grant deadline: rows read after it
        could be granted no more (``workers/claim/path.py``), so a claim whose
        read a network fault holds ends at the deadline, not at the call's
        timeout (``CALL_TIMEOUT_S``)."""
        return self._rows(keys, _timeout_until(until_ns))

    def raw_rows(self, keys: list[str], until_ns: int = 0) -> list[list]:
        """The rows of ``keys`` as the service sends them (each ``[key,
        route, cadence_s, sitemap, due_at, payload, job, version]`` as stored,
        not decoded): what the claim path in C takes (``shm/_claim_rows.c``).
        ``until_ns``: given up at it, as ``get_many_until``; 0, no deadline."""
        if not keys:
            return []
        return self._raw(keys, _timeout_until(until_ns) if until_ns else None)

    def _rows(self, keys: Iterable[str], timeout_s: float | None) -> dict[str, Row | BadRow]:
        wanted = keys if isinstance(keys, list) else list(keys)
        if not wanted:
            return {}
        return {
            stored[0]: stored_row((*stored, *_NO_OUTCOME))
            for stored in self._raw(wanted, timeout_s)
        }

    def _raw(self, wanted: list[str], timeout_s: float | None) -> list[list]:
        try:
            reply = self._ipc.call("rows", timeout_s=timeout_s, keys=wanted)
        except IpcError as exc:
            # No service to ask (killed, restarting) or one that broke off:
            # nothing was read, the caller retries.
            raise StoreUnavailable(_shown(f"{self.url}: {exc}")) from None
        except RemoteError as exc:
            if exc.code == "store_unavailable":
                raise StoreUnavailable(exc.message) from None
            raise StoreError(f"{self.url}: {exc}") from None
        rows: list[list] = reply["rows"]
        return rows

    def check_fork(self) -> None:
        return None  # the client reconnects in a child by itself

    def close(self) -> None:
        self._ipc.close()


def _timeout_until(until_ns: int) -> float:
    """A read's timeout that ends it at ``until_ns`` (CLOCK_MONOTONIC), within
    MIN_CALL_S and CALL_TIMEOUT_S."""
    left_s = (until_ns - time.monotonic_ns()) / 1e9
    return min(CALL_TIMEOUT_S, max(MIN_CALL_S, left_s))


def _shown(message: str) -> str:
    """An abstract socket's name as ``ss`` shows it (``@name``), not with its NUL."""
    return message.replace("\0", "@")
