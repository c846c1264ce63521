"""``python -m workers --index I --listen-fd FD``: one HTTP worker.

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
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import ssl
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from node import log
from node.config import Config, load_run_config, tls_context
from node.errors import NodeError
from node.proc import (
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

# How long a read of the keeper's class list is reused: every POST /rows needs
# it, and the keeper rewrites it only every state_interval_s (5 s).
CLASSES_TTL_S = 0.5
EXPLAIN_TIMEOUT_S = 0.5
# How often a stopping worker looks whether its requests in flight are done.
DRAIN_POLL_S = 0.01


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = ChildArgParser("python -m workers")
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
        for seg in (self._wake, self._state):
            if seg is not None:
                seg.close()


class _WorkSide:
    """The work path's objects for this worker: the ready set and lease table
    (shared memory); two Claimers, one for small claims on the event loop and
    one for big claims on the claim thread, each with a store connection of
    its own (a claim never queues behind a write of POST /rows); and the
    ledger's socket. Missing segments are not fatal: the work routes answer
    503 not_ready and the rest of the API still serves."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ready: Any = None
        self.leases: Any = None
        self.stores: list[Any] = []  # [inline claims' (loop thread), big claims' (claim thread)]
        self.ledger: Any = None
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="claim")

    async def start(self, ctx: Any, config: Config, wake: Any) -> Any:
        from node.ipc import AsyncClient
        from node.store import open_store
        from shm.leases import LeaseTable
        from shm.ready import ReadySet
        from workers.claim import Claimer, ledger_address
        from workers.http import readiness
        from workers.work_http import WorkPath

        try:
            self.ready = ReadySet.attach(self.name)
            self.leases = LeaseTable.attach(self.name)
        except (NodeError, OSError) as exc:
            log.warn("work_attach_failed", error=str(exc))
            return None
        loop = asyncio.get_running_loop()
        self.stores.append(open_store(config.store_url))
        self.stores.append(await loop.run_in_executor(self.thread, open_store, config.store_url))

        def claimer(store: Any) -> Claimer:
            return Claimer(
                config,
                store,
                self.ready,
                self.leases,
                wake=wake,
                is_ready=lambda: readiness(ctx)[0],
            )

        self.ledger = AsyncClient(ledger_address(self.name))
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
    from aiohttp import web

    from node.store import open_store
    from workers.console_http import routes as console_routes
    from workers.http import WorkerContext, make_app
    from workers.http_errors import SERVED, quiet_client_parse_errors
    from workers.metrics_http import count_requests
    from workers.metrics_http import routes as metrics_routes
    from workers.state_http import routes as state_routes
    from workers.work_http import routes as work_routes

    ssl_context = tls_context(config)  # before anything is opened: a bad cert fails fast
    loop = asyncio.get_running_loop()
    store_thread = ThreadPoolExecutor(1, thread_name_prefix="store")
    keeper: _KeeperSide | None = None
    work_side = _WorkSide(config.name)
    runner: web.AppRunner | None = None
    try:
        store = await loop.run_in_executor(store_thread, open_store, config.store_url)
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
            store_executor=store_thread,
        )
        ctx.work = await work_side.start(ctx, config, keeper.wake)
        app = make_app(
            ctx, extra_routes=[*work_routes, *state_routes, *metrics_routes, *console_routes]
        )
        app.middlewares.insert(0, count_requests)
        drain = _Drain(stop)

        @web.middleware
        async def count_in_flight(request: web.Request, handler: Any) -> Any:
            return await drain.track(request, handler)

        app.middlewares.append(count_in_flight)
        app.on_response_prepare.append(drain.on_response_prepare)
        quiet_client_parse_errors()
        runner = web.AppRunner(
            app, handle_signals=False, access_log=None, shutdown_timeout=config.drain_timeout_s
        )
        await runner.setup()
        site = web.SockSite(runner, sock, ssl_context=ssl_context)
        await site.start()
        log.log("worker_start", index=index, node=config.name, tls=ssl_context is not None)
        t0 = time.monotonic()
        await stop.wait()
        # Stop accepting, then let every request in flight finish, its body
        # included, before the runner closes connections: aiohttp drops the
        # bytes a closing connection receives, so a request whose headers
        # came before the stop and whose body comes after would never be
        # answered (tests/test_faults.py). Bounded by drain_timeout_s.
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
        "up_s": round(time.monotonic() - t0, 3),
    }
    if ctx.work is not None:
        claimers = [ctx.work.claimer, ctx.work.big_claimer]
        stats = [c.stats for c in claimers if c is not None]
        summary.update(
            claims=sum(s.claims for s in stats),
            granted=sum(s.granted for s in stats),
            taken=sum(s.taken for s in stats),
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


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    child_signals()
    signal.signal(signal.SIGTERM, _on_early_term)
    log.setup("worker", verbose=bool(os.environ.get("QUEUE_NODE_VERBOSE")))
    try:
        args = _parse_args(list(sys.argv[1:] if argv is None else argv))
    except UsageError as exc:
        print(f"python -m workers: {exc}", file=sys.stderr)
        return RET_USAGE
    set_title(f"qn-worker-{args.index}")
    try:
        config = load_run_config("worker")
        started_at = float(os.environ.get(ENV_STARTED_AT) or time.time())
        sock = socket.socket(fileno=args.listen_fd)
    except (NodeError, ValueError, OSError) as exc:
        print(f"python -m workers: {exc}", file=sys.stderr)
        return RET_USAGE
    try:
        asyncio.run(_run(args.index, sock, config, started_at))
    except (NodeError, OSError, ssl.SSLError) as exc:
        log.error("worker_failed", index=args.index, error=str(exc))
        return RET_ERROR
    return RET_OK


if __name__ == "__main__":
    sys.exit(main())
