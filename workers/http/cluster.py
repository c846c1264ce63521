"""``?scope=cluster``: the fleet's queue state and ledger, asked of every live
node and summed (docs/fleet.md, "The fleet as one").

A worker asked for the cluster reads the live node list from the fleet's
database (the database's clock judges, as for ownership), asks every other
live node for its own document over HTTP, all at once, with the fleet's token
(a fleet shares one), and sums the answers by the rules of
``node.fleet.cluster``. A node missing, late (no answer in
``PEER_TIMEOUT_S``), not vouching, or seeing another live list than the
database makes the answer 503 naming it: never a partial sum.

A node outside a fleet (SQLite, memory) is a fleet of one: its own document
with ``"scope": "cluster", "nodes": [<name>]``.

The node list is read on its own connection (``node.fleet.Membership``,
opened at the first cluster request, on a thread of its own so that a slow
database never holds the event loop); a peer is asked without a scope, so
the fan-out never recurses.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
from aiohttp import web

from node.core.errors import StoreError
from node.fleet import Membership
from node.fleet.cluster import SCOPE, Answer, NotSummable, Peer, judge, not_summed
from node.store import is_fleet_url
from workers.http.app import CTX, LAZY, WorkerContext

# A peer answers /queue-state and /accounting from shared memory and its
# ledger: milliseconds. One that takes longer than this is late, and the
# cluster's answer says so rather than wait on it.
PEER_TIMEOUT_S = 2.0
# The node list's read: a database that does not answer in this is down for
# the cluster's purpose (503), not waited on.
LIST_TIMEOUT_S = 2.0


class Fleet:
    """One worker's way to the other nodes: the node list and an HTTP client."""

    def __init__(self, ctx: WorkerContext) -> None:
        config = ctx.config
        self.name = ctx.name
        self.token = config.token
        self.scheme = "https" if config.tls_cert else "http"
        self.ssl: ssl.SSLContext | bool = True
        if config.tls_cert:
            # The fleet's nodes present the fleet's certificate (or one it signed).
            self.ssl = ssl.create_default_context(cafile=str(config.tls_cert))
        self.membership = Membership(
            config.store_url, config.name, config.http,
            membership_timeout_s=config.membership_timeout_s,
            connect_timeout_s=int(LIST_TIMEOUT_S), statement_timeout_s=LIST_TIMEOUT_S,
        )  # fmt: skip
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="fleet-list")
        self._session: aiohttp.ClientSession | None = None

    async def live(self) -> list[Peer]:
        """The live nodes, as the database judges them now."""
        loop = asyncio.get_running_loop()
        live = await loop.run_in_executor(self._thread, self.membership.live)
        return [Peer(m.name, m.address) for m in live.members]

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def ask(self, peer: Peer, path: str) -> Answer:
        """One GET of ``path`` on ``peer``, within PEER_TIMEOUT_S."""
        timeout = aiohttp.ClientTimeout(total=PEER_TIMEOUT_S)
        try:
            if peer.address.startswith("unix:"):
                connector = aiohttp.UnixConnector(path=peer.address[len("unix:") :])
                async with aiohttp.ClientSession(connector=connector) as session:
                    return await _get(session, peer, f"http://localhost{path}", self, timeout)
            if self._session is None or self._session.closed:
                self._session = aiohttp.ClientSession()
            url = f"{self.scheme}://{peer.address}{path}"
            return await _get(self._session, peer, url, self, timeout)
        except TimeoutError:
            return Answer(peer, error=f"no answer in {PEER_TIMEOUT_S:g} s")
        except (aiohttp.ClientError, OSError) as exc:
            return Answer(peer, error=f"cannot be reached: {exc or type(exc).__name__}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.membership.close()


async def _get(
    session: aiohttp.ClientSession, peer: Peer, url: str, fleet: Fleet, timeout: Any
) -> Answer:
    async with session.get(url, headers=fleet._headers(), ssl=fleet.ssl, timeout=timeout) as resp:
        raw = await resp.read()
    try:
        return Answer(peer, resp.status, json.loads(raw))
    except ValueError:
        return Answer(peer, resp.status, error=f"answered {resp.status} without JSON")


def _fleet(app: web.Application) -> Fleet:
    """This worker's Fleet, opened at the first cluster request."""
    lazy = app[LAZY]
    if "fleet" not in lazy:
        lazy["fleet"] = Fleet(app[CTX])
    fleet: Fleet = lazy["fleet"]
    return fleet


def in_a_fleet(ctx: WorkerContext) -> bool:
    return is_fleet_url(ctx.config.store_url)


Local = Callable[[], Awaitable[tuple[int, Any]]]


class Refused(Exception):
    """No sum: why (``reason``), the nodes that failed (``missing``) and the
    live list read (``live``; empty when it could not be read)."""

    def __init__(self, reason: str, missing: list[str], live: list[Peer]) -> None:
        super().__init__(reason)
        self.reason, self.missing, self.live = reason, missing, live


async def gather(
    request: web.Request, path: str, local: Local, queue_state: bool
) -> tuple[list[Peer], dict[str, Any]]:
    """The live list and every live node's answer to ``path`` (this node's
    from ``local``), judged summable, by node name. Raises Refused (the node
    list could not be read, a node is missing, late or not vouching)."""
    fleet = _fleet(request.app)
    try:
        live = await fleet.live()
    except StoreError as exc:
        raise Refused(f"the node list cannot be read: {exc}", [], []) from None
    if not any(p.name == fleet.name for p in live):
        why = f"this node ({fleet.name}) is not on the live node list"
        raise Refused(why, [fleet.name], live)

    async def answer(peer: Peer) -> Answer:
        if peer.name != fleet.name:
            return await fleet.ask(peer, path)
        status, doc = await local()
        return Answer(peer, status, doc)

    answers = await asyncio.gather(*(answer(p) for p in live))
    try:
        return live, judge(answers, queue_state=queue_state)
    except NotSummable as exc:
        raise Refused(exc.reason, exc.missing, live) from None


__all__ = ["SCOPE", "Fleet", "Refused", "gather", "in_a_fleet", "not_summed"]
