"""``python -m workers.http --index I --listen-fd FD``: one HTTP worker.

Started by the supervisor, which owns the listening socket and passes it down
(every worker accepts on the same socket; the kernel spreads connections). The
resolved configuration comes from the JSON file named by
``QUEUE_NODE_RUN_CONFIG``, the node's start time from
``QUEUE_NODE_STARTED_AT``.

Signals: SIGINT is ignored (the supervisor drains us); SIGTERM only sets an
event, and the main coroutine then stops accepting, lets requests in flight
finish (up to ``drain_timeout_s``), logs one summary line and exits 0.

Store thread: the store is opened on one thread and used only from it
(``WorkerContext.store_executor``), so a slow write never blocks the event
loop and no connection is shared between threads.

Connections (``_Connections``): at most ``max_connections`` open at once (one
more is answered 503 ``too_many_connections`` and closed, never queued), an
idle keep-alive connection is closed after ``keepalive_s`` (aiohttp's own
default keeps it an hour), and a request's headers must arrive within
``header_timeout_s`` (aiohttp has no such limit: a client trickling header
bytes would hold its connection for as long as it likes).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import resource
import signal
import socket
import ssl
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from node.core import log
from node.core.config import Config, load_run_config, tls_context
from node.core.errors import NodeError
from node.core.proc import (
    ENV_STARTED_AT,
    RET_ERROR,
    RET_OK,
    RET_USAGE,
    ChildArgParser,
    UsageError,
    child_signals,
    die_with_parent,
    set_title,
)
from workers.http.errors import json_parse_errors, raw_error

# How long a read of the keeper's class list is reused: every POST /rows needs
# it, and the keeper rewrites it only every state_interval_s (5 s).
CLASSES_TTL_S = 0.5
EXPLAIN_TIMEOUT_S = 0.5
# How often a stopping worker looks whether its requests in flight are done.
DRAIN_POLL_S = 0.01
# A connection past max_connections is answered once its request's headers
# are in (closing with them unread could reset the connection before the
# client reads the answer), or after this long, whichever comes first.
REFUSE_WAIT_S = 1.0
# What a client refused for too many connections is told to wait.
CONNECTIONS_RETRY_AFTER_S = 1


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = ChildArgParser("python -m workers.http")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--listen-fd", type=int, required=True)
    return p.parse_args(argv)


class _KeeperSide:
    """The keeper's shared memory and ask queue, as WorkerContext callables.

    Missing segments are not fatal: the worker still takes writes (the keeper
    finds them on its next poll without the nudge), and /readyz says why it
    is not ready."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._wake: Any = None
        self._state: Any = None
        self._classes: set = set()
        self._classes_at = float("-inf")
        # The shared class table a write reserves its classes in (None:
        # the check falls back to the classes of the state document).
        from shm.classes import attach_or_none

        self.classes = attach_or_none(name)
        if self.classes is None:
            log.warn("classes_attach_failed", node=name)
        try:
            from shm.wake import Wake

            self._wake = Wake.attach(name)
        except (ImportError, NodeError, OSError) as exc:
            log.warn("wake_attach_failed", error=str(exc))
        try:
            from shm.state import StateBuffer

            self._state = StateBuffer.attach(name)
        except (ImportError, NodeError, OSError) as exc:
            log.warn("state_attach_failed", error=str(exc))

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.post()

    def keeper_state(self) -> dict[str, Any] | None:
        return None if self._state is None else self._state.read()

    def known_classes(self) -> set:
        from workers.classes import classes_from_state

        now = time.monotonic()
        if now - self._classes_at >= CLASSES_TTL_S:
            self._classes = classes_from_state(self.keeper_state())
            self._classes_at = now
        return self._classes

    def explain(self, key: str) -> dict[str, Any] | None:
        from keeper.ask import ask

        answer = ask(self.name, {"op": "explain", "key": key}, timeout_s=EXPLAIN_TIMEOUT_S)
        if answer is not None:
            answer.pop("id", None)
        return answer

    def close(self) -> None:
        for seg in (self._wake, self._state, self.classes):
            if seg is not None:
                seg.close()


class _WorkSide:
    """The work path's objects for this worker: the ready set and lease table
    (shared memory); two Claimers, one for small claims on the event loop and
    one for big claims on the claim thread, each with a store connection of
    its own (a claim never queues behind a write of POST /rows; on
    PostgreSQL each reads through the node's row service instead); and the
    ledger's socket. Missing segments are not fatal: the work routes answer
    503 not_ready and the rest of the API still serves."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ready: Any = None
        self.leases: Any = None
        self.stores: list[Any] = []  # [inline claims' (loop thread), big claims' (claim thread)]
        self.ledger: Any = None
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="claim")

    def grant_until_ns(self) -> int:
        """The ready set's grant deadline (0 before it is attached: none)."""
        return 0 if self.ready is None else int(self.ready.grant_until_ns)

    async def start(self, ctx: Any, config: Config, wake: Any) -> Any:
        from node.core.names import ledger_address
        from node.ipc import AsyncIpcClient
        from node.store import is_fleet_url, open_store
        from shm.leases import LeaseTable
        from shm.ready import ReadySet
        from workers.claim import Claimer
        from workers.http.app import readiness
        from workers.http.work import WorkPath
        from workers.rows import RowsClient

        try:
            self.ready = ReadySet.attach(self.name)
            self.leases = LeaseTable.attach(self.name)
        except (NodeError, OSError) as exc:
            log.warn("work_attach_failed", error=str(exc))
            return None
        loop = asyncio.get_running_loop()
        if is_fleet_url(config.store_url):
            # On PostgreSQL the claims read through the node's row service
            # (workers/rows): a worker holds no connection for them.
            self.stores.append(RowsClient(self.name))
            self.stores.append(RowsClient(self.name))
        else:
            self.stores.append(open_store(config.store_url, node_name=config.name))
            self.stores.append(
                await loop.run_in_executor(
                    self.thread,
                    functools.partial(open_store, config.store_url, node_name=config.name),
                )
            )

        def claimer(store: Any) -> Claimer:
            return Claimer(
                config,
                store,
                self.ready,
                self.leases,
                wake=wake,
                is_ready=lambda: readiness(ctx)[0],
            )

        self.ledger = AsyncIpcClient(ledger_address(self.name))
        return WorkPath(
            claimer(self.stores[0]),
            self.leases,
            self.ledger,
            claim_executor=self.thread,
            big_claimer=claimer(self.stores[1]),
        )

    async def close(self) -> None:
        if self.ledger is not None:
            await self.ledger.close()
        if len(self.stores) > 1:
            await asyncio.get_running_loop().run_in_executor(self.thread, self.stores[1].close)
        if self.stores:
            self.stores[0].close()
        self.thread.shutdown(wait=True)
        for seg in (self.ready, self.leases):
            if seg is not None:
                seg.close()


class _Connections:
    """This worker's open connections, and the bounds on them.

    Every accepted connection gets a ``_Guard`` around aiohttp's protocol,
    which sees the connection open and close and every byte arrive; the
    app's outermost middleware (``track``) tells it when a request starts
    and ends. The header clock runs from the connection's start (for its
    first request) or from the first byte after a request ended (for the
    next one on a keep-alive connection) until a request starts; it never
    runs while a request is handled, so a long poll is never cut."""

    def __init__(self, limit: int, header_timeout_s: float) -> None:
        self.limit = limit
        self.header_timeout_s = header_timeout_s
        self.open: dict[asyncio.BaseTransport, _Guard] = {}
        # Accepted, not connected yet: asyncio accepts a burst of connections
        # before any of them is connected (a TLS one after its handshake), so
        # counting only ``open`` would let a burst past the limit. Weak: a
        # connection whose TLS handshake fails is never connected, and
        # leaves this set when asyncio drops it.
        self.pending: weakref.WeakSet[_Guard] = weakref.WeakSet()
        self.refused = 0
        self.header_timeouts = 0

    def factory(self, make_protocol: Any) -> Any:
        """The protocol factory for ``loop.create_server``."""

        def protocol() -> asyncio.Protocol:
            if len(self.open) + len(self.pending) >= self.limit:
                return _Refuse(self)
            guard = _Guard(self, json_parse_errors(make_protocol()))
            self.pending.add(guard)
            return guard

        return protocol

    @web.middleware
    async def track(self, request: web.Request, handler: Any) -> Any:
        guard = self.open.get(request.transport)  # type: ignore[arg-type]
        if guard is not None:
            guard.request_started()
        try:
            return await handler(request)
        finally:
            if guard is not None:
                guard.request_ended()


class _Guard(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the header clock."""

    def __init__(self, connections: _Connections, inner: asyncio.Protocol) -> None:
        self.connections = connections
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.clock: asyncio.TimerHandle | None = None
        self.in_request = False
        self.between = False  # a request ended; the next byte starts the clock
        self.bytes_since_clock = 0

    def _start_clock(self) -> None:
        loop = asyncio.get_running_loop()
        self.bytes_since_clock = 0
        self.clock = loop.call_later(self.connections.header_timeout_s, self._headers_too_slow)

    def _stop_clock(self) -> None:
        if self.clock is not None:
            self.clock.cancel()
            self.clock = None

    def _headers_too_slow(self) -> None:
        self.clock = None
        if self.in_request or self.transport is None or self.transport.is_closing():
            return
        self.connections.header_timeouts += 1
        if self.bytes_since_clock:  # a request was begun: say why it ends
            limit = self.connections.header_timeout_s
            self.transport.write(
                raw_error(408, "header_timeout", f"the request's headers took over {limit:g} s")
            )
        self.transport.close()

    def request_started(self) -> None:
        self._stop_clock()
        self.in_request = True
        self.between = False

    def request_ended(self) -> None:
        self.in_request = False
        self.between = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connections.pending.discard(self)
        self.connections.open[transport] = self
        self._start_clock()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.between and not self.in_request:
            self.between = False
            self._start_clock()
        self.bytes_since_clock += len(data)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        if self.transport is not None:
            self.connections.open.pop(self.transport, None)
        self.inner.connection_lost(exc)


class _Refuse(asyncio.Protocol):
    """A connection past ``max_connections``: answered 503 and closed."""

    def __init__(self, connections: _Connections) -> None:
        self.connections = connections
        self.transport: asyncio.Transport | None = None
        self.seen = b""  # the last bytes received, for an end of headers across reads
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connections.refused += 1
        self.timer = asyncio.get_running_loop().call_later(REFUSE_WAIT_S, self._answer)

    def data_received(self, data: bytes) -> None:
        window = self.seen + data
        if b"\r\n\r\n" in window or b"\n\n" in window:  # the request's headers are in
            self._answer()
        self.seen = window[-3:]

    def _answer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is None or self.transport.is_closing():
            return
        limit = self.connections.limit
        self.transport.write(
            raw_error(
                503,
                "too_many_connections",
                f"this worker has {limit} connections open (max_connections); retry",
                {"Retry-After": str(CONNECTIONS_RETRY_AFTER_S)},
            )
        )
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class _BoundedSite(web.SockSite):
    """aiohttp's SockSite, with every connection going through ``_Connections``."""

    def __init__(
        self,
        runner: web.AppRunner,
        sock: socket.socket,
        connections: _Connections,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        super().__init__(runner, sock, ssl_context=ssl_context)
        self.connections = connections

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.connections.factory(self._runner.server),
            sock=self._sock,
            ssl=self._ssl_context,
            backlog=self._backlog,
        )


class _Drain:
    """Counts requests in flight, and ends keep-alive once the worker stops."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.in_flight = 0

    async def track(self, request: Any, handler: Any) -> Any:
        self.in_flight += 1
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1

    async def on_response_prepare(self, request: Any, response: Any) -> None:
        if self.stop.is_set():
            response.force_close()

    async def wait(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)  # polling a counter, bounded by the deadline


async def serve(
    index: int, sock: socket.socket, config: Config, started_at: float, stop: asyncio.Event
) -> dict[str, Any]:
    """Serve until ``stop`` is set; returns what was served."""
    from node.store import open_store
    from workers.http.app import WorkerContext, make_app
    from workers.http.console import routes as console_routes
    from workers.http.errors import SERVED, quiet_client_parse_errors
    from workers.http.metrics import count_requests
    from workers.http.metrics import routes as metrics_routes
    from workers.http.results import routes as results_routes
    from workers.http.state import routes as state_routes
    from workers.http.work import routes as work_routes

    ssl_context = tls_context(config)  # before anything is opened: a bad cert fails fast
    loop = asyncio.get_running_loop()
    store_thread = ThreadPoolExecutor(1, thread_name_prefix="store")
    keeper: _KeeperSide | None = None
    work_side = _WorkSide(config.name)
    runner: web.AppRunner | None = None
    try:
        store = await loop.run_in_executor(
            store_thread, functools.partial(open_store, config.store_url, node_name=config.name)
        )
        keeper = _KeeperSide(config.name)
        ctx = WorkerContext(
            config=config,
            store=store,
            name=config.name,
            started_at=started_at,
            wake=keeper.wake,
            keeper_state=keeper.keeper_state,
            explain=keeper.explain,
            known_classes=keeper.known_classes,
            classes=keeper.classes,
            store_executor=store_thread,
        )
        ctx.work = await work_side.start(ctx, config, keeper.wake)
        ctx.grant_until_ns = work_side.grant_until_ns
        app = make_app(
            ctx,
            extra_routes=[
                *work_routes, *results_routes, *state_routes, *metrics_routes, *console_routes,
            ],
        )
        app.middlewares.insert(0, count_requests)
        drain = _Drain(stop)

        @web.middleware
        async def count_in_flight(request: web.Request, handler: Any) -> Any:
            return await drain.track(request, handler)

        app.middlewares.append(count_in_flight)
        connections = _Connections(config.max_connections, config.header_timeout_s)
        app.middlewares.insert(0, connections.track)
        app.on_response_prepare.append(drain.on_response_prepare)
        quiet_client_parse_errors()
        runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=config.drain_timeout_s,
            keepalive_timeout=config.keepalive_s,
        )
        await runner.setup()
        site = _BoundedSite(runner, sock, connections, ssl_context)
        await site.start()
        log.log("worker_start", index=index, node=config.name, tls=ssl_context is not None)
        t0 = time.monotonic()
        await stop.wait()
        # Stop accepting, then let every request in flight finish, its body
        # included, before the runner closes connections: aiohttp drops the
        # bytes a closing connection receives, so a request whose headers
        # came before the stop and whose body comes after would never be
        # answered (tests/campaign/test_faults.py). Bounded by drain_timeout_s.
        await site.stop()
        await drain.wait(loop.time() + config.drain_timeout_s)
        await runner.cleanup()
        runner = None
        await loop.run_in_executor(store_thread, store.close)
    finally:
        if runner is not None:
            await runner.cleanup()
        store_thread.shutdown(wait=True)
        await work_side.close()
        if keeper is not None:
            keeper.close()
    served = app[SERVED]
    summary = {
        "requests": served.requests,
        "client_errors": served.client_errors,
        "internal_errors": served.internal_errors,
        "connections_refused": connections.refused,
        "header_timeouts": connections.header_timeouts,
        "up_s": round(time.monotonic() - t0, 3),
    }
    if ctx.work is not None:
        claimers = [ctx.work.claimer, ctx.work.big_claimer]
        stats = [c.stats for c in claimers if c is not None]
        summary.update(
            claims=sum(s.claims for s in stats),
            granted=sum(s.granted for s in stats),
            taken=sum(s.taken for s in stats),
            not_granting=sum(s.not_granting for s in stats),
        )
    return summary


# A SIGTERM that lands before the event loop owns the signal must not be lost.
_early_stop = {"requested": False}


def _on_early_term(signum: int, frame: object) -> None:
    _early_stop["requested"] = True


async def _run(index: int, sock: socket.socket, config: Config, started_at: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # The handler only sets the event; the coroutine does the stopping.
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if _early_stop["requested"]:
        stop.set()
    summary = await serve(index, sock, config, started_at, stop)
    log.log("worker_stop", index=index, **summary)


# Descriptors a worker needs besides its connections: the store, the ledger,
# the segments, the log, the metrics files, the console's files.
FD_MARGIN = 256


def _raise_fd_limit(max_connections: int) -> None:
    """Raise the soft limit on open files to what ``max_connections`` needs
    (the common soft limit is 1,024, the default bound): otherwise accept()
    fails with EMFILE before the bound's 503 is ever answered. Up to the hard
    limit; a hard limit below it is said once in the log."""
    want = max_connections + FD_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warn("fd_limit_low", max_connections=max_connections, nofile=new,
                     hint="raise the hard limit (ulimit -Hn) or lower max_connections")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    child_signals()
    signal.signal(signal.SIGTERM, _on_early_term)
    log.setup("worker", verbose=bool(os.environ.get("QUEUE_NODE_VERBOSE")))
    try:
        args = _parse_args(list(sys.argv[1:] if argv is None else argv))
    except UsageError as exc:
        print(f"python -m workers.http: {exc}", file=sys.stderr)
        return RET_USAGE
    set_title(f"qn-worker-{args.index}")
    try:
        config = load_run_config("worker")
        _raise_fd_limit(config.max_connections)
        started_at = float(os.environ.get(ENV_STARTED_AT) or time.time())
        sock = socket.socket(fileno=args.listen_fd)
    except (NodeError, ValueError, OSError) as exc:
        print(f"python -m workers.http: {exc}", file=sys.stderr)
        return RET_USAGE
    try:
        asyncio.run(_run(args.index, sock, config, started_at))
    except (NodeError, OSError, ssl.SSLError) as exc:
        log.error("worker_failed", index=args.index, error=str(exc))
        return RET_ERROR
    return RET_OK


if __name__ == "__main__":
    sys.exit(main())
