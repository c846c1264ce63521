"""The row service process: a PostgreSQL node's claim reads through one pool.

Started by the supervisor on a node whose store is PostgreSQL (role
``rows``), restarted like any child when it dies. It listens on the abstract
UNIX socket ``\\0queue-node.<name>.rows`` and answers each request
``{"op": "rows", "id", "keys": [...]}`` with ``{"id", "rows": [[key, route,
cadence_s, sitemap, due_at, payload, job, version], …]}`` (the rows found,
as stored; the client decodes them), read by one ``SELECT … WHERE key =
ANY($1)`` (``CLAIM_ROWS``). Framing is the ledger's (``node/ipc.py``: u32
length, msgpack map). A failure of the store is answered
``{"error": {"code": "store_unavailable" | "store_error", "message"}}``.

Why a process, and why threads:

- Not a thread of the keeper (it does nothing but keep: a slow read must
  never stall a publish) nor of the ledger (its event loop is the
  completion path's; a blocking read there would hold up group commits).
  A process of its own is restarted by the supervisor and can be killed on
  its own, which is what its clients are written against.
- One thread per client connection, blocking sockets and the blocking
  psycopg pool. A read is one round trip to the server, which releases the
  GIL; a client (a GPU process, an HTTP worker's claimer) sends one request
  at a time, so a thread never waits behind another client's socket. The
  pool bounds the statements in flight (``ROWS_POOL_MAX``); a request that
  finds every connection busy waits for one (psycopg_pool, up to its
  CONNECT_TIMEOUT_S, then ``store_unavailable``). An asyncio loop would need
  psycopg's async pool and gain nothing at this size: the number of
  clients is the host's claiming processes (tens, not thousands).

Only this node's user may connect (the peer's uid, as the ledger checks);
clients check the service's uid before they send (``node.ipc.check_peer``).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from node.core import log
from node.core.config import load_run_config
from node.core.errors import NodeError, StoreError, StoreUnavailable
from node.core.names import rows_address
from node.core.proc import RET_ERROR, RET_OK, child_signals, die_with_parent, drain_pipe, set_title
from node.ipc import IpcError, pack, peer_uid, recv_frame

# Connections the service's pool may open: one stays open; a second and
# third serve claims that arrive together (the HTTP workers' and the GPU
# processes' claims overlap under load). This is the node's whole claim-path
# budget against max_connections, whatever the number of its GPU processes.
ROWS_POOL_MAX = 3
# The most keys one request may name: a claim reads at most its batch (the
# HTTP API allows 1,000 a claim); past this the request is refused whole.
MAX_KEYS = 10_000
# The accept loop's wake-up with nothing to do (SIGTERM also wakes it).
IDLE_WAKE_S = 1.0


@dataclass
class RowStats:
    """What the service did, for its shutdown line."""

    requests: int = 0
    keys: int = 0
    rows: int = 0
    errors: int = 0
    clients: int = 0


class RowService:
    """Answers row reads on ``rows_address(name)`` from ``store`` (a
    PostgresStore: ``claim_rows``)."""

    def __init__(self, name: str, store: Any) -> None:
        self.name = name
        self.store = store
        self.stats = RowStats()
        self._stats_lock = threading.Lock()
        self._stop = False
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # An abstract name: no file, no mode. A second service of this
            # name (or another user's squatter) makes bind fail: exit, and the
            # supervisor's backoff retries.
            self.listener.bind(rows_address(name))
        except OSError:
            self.listener.close()
            raise
        self.listener.listen(256)

    def stop(self) -> None:
        self._stop = True

    def serve(self, wake_fd: int) -> None:
        """Accept clients until ``stop()`` (a SIGTERM, which also writes to
        ``wake_fd``), each on a thread of its own."""
        listen_fd = self.listener.fileno()
        while not self._stop:
            ready, _w, _x = select.select([listen_fd, wake_fd], [], [], IDLE_WAKE_S)
            if wake_fd in ready:
                drain_pipe(wake_fd)
            if listen_fd not in ready:
                continue
            try:
                sock, _addr = self.listener.accept()
            except OSError:
                continue  # the client gave up between select and accept
            pid, uid = peer_uid(sock)
            if uid != os.getuid():
                log.warn("rows_refused", peer_pid=pid, peer_uid=uid)
                sock.close()
                continue
            with self._stats_lock:
                self.stats.clients += 1
            threading.Thread(
                target=self._client, args=(sock,), name=f"rows-{pid}", daemon=True
            ).start()
        self.listener.close()

    # -- one client ----------------------------------------------------------------

    def _client(self, sock: socket.socket) -> None:
        with sock:
            while True:
                try:
                    request = recv_frame(sock)
                except (OSError, IpcError):
                    return  # the client went away mid-frame, or broke the protocol
                if request is None:
                    return
                reply = self.answer(request)
                reply["id"] = request.get("id")
                try:
                    sock.sendall(pack(reply))
                except OSError:
                    return

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        keys = request.get("keys")
        if request.get("op") != "rows":
            return _error("bad_request", f"unknown op {request.get('op')!r}: only 'rows'")
        if not isinstance(keys, list) or len(keys) > MAX_KEYS:
            return _error("bad_request", f"keys must be a list of at most {MAX_KEYS} strings")
        if not all(type(key) is str for key in keys):
            return _error("bad_request", "every key must be a string")
        try:
            rows = self.store.claim_rows(keys)
        except StoreUnavailable as exc:
            self._count(len(keys), 0, error=True)
            return _error("store_unavailable", str(exc))
        except StoreError as exc:
            self._count(len(keys), 0, error=True)
            return _error("store_error", str(exc))
        self._count(len(keys), len(rows))
        return {"rows": rows}

    def _count(self, keys: int, rows: int, error: bool = False) -> None:
        with self._stats_lock:
            stats = self.stats
            stats.requests += 1
            stats.keys += keys
            stats.rows += rows
            stats.errors += error


def _error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


# -- process ---------------------------------------------------------------------------


def main() -> int:
    die_with_parent()
    child_signals()
    set_title("qn-rows")
    log.setup("rows", verbose=bool(os.environ.get("QUEUE_NODE_VERBOSE")))
    rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    service: RowService | None = None

    def on_term(signum: int, frame: object) -> None:
        if service is not None:
            service.stop()  # a flag; the wake-up fd ends the select

    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGTERM, on_term)
    started = time.time()
    try:
        from node.store.postgres import PostgresStore

        config = load_run_config("row service")
        store = PostgresStore(config.store_url, node_name=config.name, pool_max=ROWS_POOL_MAX)
        try:
            service = RowService(config.name, store)
        except OSError as exc:
            store.close()
            raise NodeError(f"cannot listen on @{rows_address(config.name)[1:]}: {exc}") from None
    except (NodeError, OSError) as exc:  # no server yet; a second service of this name
        log.error("rows_failed", error=str(exc))
        return RET_ERROR
    log.log("rows_start", pool_max=ROWS_POOL_MAX)
    service.serve(rfd)
    store.close()
    s = service.stats
    log.log("rows_stop", up_s=round(time.time() - started, 1), clients=s.clients,
            requests=s.requests, keys=s.keys, rows=s.rows, errors=s.errors)  # fmt: skip
    return RET_OK


if __name__ == "__main__":
    sys.exit(main())
