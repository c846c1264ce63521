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
from node.core.ids import number_of, shown_ids
from node.fleet import Membership
from node.fleet.cluster import SCOPE, Answer, Down, NotSummable, Peer, judge, not_summed
from node.store import is_fleet_url
from workers.http.app import CTX, LAZY, WorkerContext
from workers.http.errors import ApiError

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
        self.turn = 0  # the node a fleet poll asks first turns with each poll

    async def listing(self) -> tuple[list[Peer], list[Down]]:
        """The live nodes, as the database judges them now, and the others
        on the list (left or lapsed): one read."""
        loop = asyncio.get_running_loop()
        live, absent = await loop.run_in_executor(self._thread, self.membership.listing)
        down = [
            Down(a.member.name, a.member.address, a.member.number,
                 live.db_now - a.member.heartbeat_at, a.left)
            for a in absent
        ]  # fmt: skip
        return [Peer(m.name, m.address) for m in live.members], down

    async def holders(self) -> dict[int, tuple[Peer, bool]]:
        """Every node on the list by number: where it serves, whether live."""
        loop = asyncio.get_running_loop()
        nodes = await loop.run_in_executor(self._thread, self.membership.nodes)
        return {m.number: (Peer(m.name, m.address), live) for m, live in nodes}

    async def holders_or_503(self) -> dict[int, tuple[Peer, bool]]:
        """``holders``, or 503 ``peer_unavailable`` when the list cannot be read."""
        try:
            return await self.holders()
        except StoreError as exc:
            why = f"the node list cannot be read: {exc}"
            raise ApiError(503, "peer_unavailable", why) from None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def ask(self, peer: Peer, path: str, body: Any = None) -> Answer:
        """One GET of ``path`` on ``peer`` (a POST of ``body`` when given),
        within PEER_TIMEOUT_S."""
        timeout = aiohttp.ClientTimeout(total=PEER_TIMEOUT_S)
        try:
            if peer.address.startswith("unix:"):
                connector = aiohttp.UnixConnector(path=peer.address[len("unix:") :])
                async with aiohttp.ClientSession(connector=connector) as session:
                    url = f"http://localhost{path}"
                    return await _send(session, peer, url, self, timeout, body)
            if self._session is None or self._session.closed:
                self._session = aiohttp.ClientSession()
            url = f"{self.scheme}://{peer.address}{path}"
            return await _send(self._session, peer, url, self, timeout, body)
        except TimeoutError:
            return Answer(peer, error=f"no answer in {PEER_TIMEOUT_S:g} s")
        except (aiohttp.ClientError, OSError) as exc:
            return Answer(peer, error=f"cannot be reached: {exc or type(exc).__name__}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.membership.close()


async def _send(
    session: aiohttp.ClientSession, peer: Peer, url: str, fleet: Fleet, timeout: Any, body: Any
) -> Answer:
    method = "GET" if body is None else "POST"
    async with session.request(
        method, url, json=body, headers=fleet._headers(), ssl=fleet.ssl, timeout=timeout
    ) as resp:
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
    # config.store, not store_url: none named ("") is the SQLite default, no
    # fleet, and store_url resolves the data directory (every poll and ack).
    return is_fleet_url(ctx.config.store)


def my_number(ctx: WorkerContext) -> int | None:
    """This node's fleet number as its keeper last wrote it (None: unknown)."""
    try:
        state = ctx.keeper_state()
        number = state["doc"]["trust"]["membership"]["number"]  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    return number if isinstance(number, int) else None


Local = Callable[[], Awaitable[tuple[int, Any]]]


class Refused(Exception):
    """No sum: why (``reason``), the nodes that failed (``missing``), the
    live list read (``live``; empty when it could not be read), what each
    node answered (``answers``: none when none was asked) and the nodes on
    the list that are not live (``down``; None when it could not be read)."""

    def __init__(
        self,
        reason: str,
        missing: list[str],
        live: list[Peer],
        answers: list[Answer] | None = None,
        down: list[Down] | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason, self.missing, self.live = reason, missing, live
        self.answers = answers or []
        self.down = down

    def document(self, queue_state: bool) -> dict[str, Any]:
        """The 503's document (``node.fleet.cluster.not_summed``)."""
        return not_summed(self.reason, self.missing, self.live, self.answers, self.down,
                          queue_state=queue_state)  # fmt: skip


class Gathered:
    """Every live node's answer, judged summable (``docs``, by node name),
    the live list it was asked by, and the nodes on the list that are not
    live (``down``)."""

    def __init__(self, live: list[Peer], docs: dict[str, Any], down: list[Down]) -> None:
        self.live, self.docs, self.down = live, docs, down

    @property
    def addresses(self) -> dict[str, str]:
        return {p.name: p.address for p in self.live}


async def gather(request: web.Request, path: str, local: Local, queue_state: bool) -> Gathered:
    """Every live node's answer to ``path`` (this node's from ``local``),
    judged summable. Raises Refused (the node list could not be read, a node
    is missing, late or not vouching)."""
    fleet = _fleet(request.app)
    try:
        live, down = await fleet.listing()
    except StoreError as exc:
        raise Refused(f"the node list cannot be read: {exc}", [], []) from None
    if not any(p.name == fleet.name for p in live):
        why = f"this node ({fleet.name}) is not on the live node list"
        raise Refused(why, [fleet.name], live, down=down)

    async def answer(peer: Peer) -> Answer:
        if peer.name != fleet.name:
            return await fleet.ask(peer, path)
        status, doc = await local()
        return Answer(peer, status, doc)

    answers = await asyncio.gather(*(answer(p) for p in live))
    try:
        return Gathered(live, judge(answers, queue_state=queue_state), down)
    except NotSummable as exc:
        raise Refused(exc.reason, exc.missing, live, answers, down) from None


def _unavailable(peer: Peer, answer: Answer) -> ApiError:
    """503 ``peer_unavailable`` for a node that did not answer as asked."""
    error = answer.doc.get("error") if isinstance(answer.doc, dict) else None
    why = answer.error or f"answered {answer.status}: {error or answer.doc}"
    return ApiError(503, "peer_unavailable", f"node {peer.name} at {peer.address}: {why}")


# -- one node, by name -----------------------------------------------------------------


async def ask_node(request: web.Request, node: str, path: str, body: Any) -> dict[str, Any]:
    """POST ``body`` to ``path`` on the fleet's node ``node`` (an operator's
    act for that node: its pause lives in its own meta, read by its own
    keeper). Its answer, with ``"node"``; or ApiError: 404 ``unknown_node``
    (not on the node list), 503 ``peer_unavailable`` (down, or no answer)."""
    fleet = _fleet(request.app)
    holders = await fleet.holders_or_503()
    found = [(peer, live) for peer, live in holders.values() if peer.name == node]
    if not found:
        raise ApiError(404, "unknown_node", f"no node {node} on the node list", "node")
    peer, live = found[0]
    if not live:
        raise ApiError(503, "peer_unavailable", f"node {node} at {peer.address} is down: "
                       "ask again once it is back")  # fmt: skip
    answer = await fleet.ask(peer, path, body)
    if answer.status == 200 and isinstance(answer.doc, dict):
        return {**answer.doc, "node": node}
    raise _unavailable(peer, answer)


# -- results from the whole fleet -----------------------------------------------------

# A fleet poll that waits asks the nodes again this often (each is asked with
# wait_s=0: a node asked to wait would hold results it offered while another
# node's answer was already enough, unseen until their offers time out).
FLEET_POLL_EVERY_S = 0.2

LocalPoll = Callable[[int], Awaitable[list[dict[str, Any]]]]


async def poll_fleet(
    request: web.Request, path: str, max_n: int, wait_s: float, local: LocalPoll
) -> dict[str, Any]:
    """Up to ``max_n`` results from the live nodes, asked one after another
    (each for what is still wanted, starting at a node that turns with each
    poll), until some come or ``wait_s`` passes. ``unavailable``: the nodes
    on the list that are down or did not answer: their results wait on their
    disks (docs/fleet.md, "Results from the whole fleet")."""
    fleet = _fleet(request.app)
    holders = await fleet.holders_or_503()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    nodes = [holders[n] for n in sorted(holders)]
    while True:
        fleet.turn = (fleet.turn + 1) % max(1, len(nodes))
        results: list[dict[str, Any]] = []
        unavailable: list[dict[str, Any]] = []
        for peer, live in nodes[fleet.turn :] + nodes[: fleet.turn]:
            if not live:
                unavailable.append({"node": peer.name, "address": peer.address, "reason": "down"})
                continue
            left = max_n - len(results)
            if left <= 0:
                continue
            if peer.name == fleet.name:
                results += await local(left)
                continue
            answer = await fleet.ask(peer, f"{path}?max={left}&wait_s=0")
            if answer.status == 200 and isinstance(answer.doc, dict):
                results += answer.doc.get("results") or []
            else:
                why = answer.error or f"answered {answer.status}"
                unavailable.append({"node": peer.name, "address": peer.address, "reason": why})
        left_s = deadline - loop.time()
        if results or left_s <= 0:
            return {"results": results, "unavailable": unavailable}
        await asyncio.sleep(min(FLEET_POLL_EVERY_S, left_s))


# -- acks routed by their ids' numbers --------------------------------------------------


LocalAck = Callable[[list[int], bool], Awaitable[dict[str, Any]]]


async def _checked(job: str, checks: list[Any], unheld: list[int]) -> list[dict[str, Any]]:
    """Every share's check, at once: their answers; or, in this order, the
    first failure that is not an answer of the API's (a bug: never hidden),
    409 ``never_offered`` naming every id never offered (each node's
    refusal, and ``unheld``: ids of a number no node holds), the first other
    refusal (a node that does not answer: 503)."""
    answers = await asyncio.gather(*checks, return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, ApiError):
            raise answer
    named = [str(a) for a in answers if isinstance(a, ApiError) and a.code == "never_offered"]
    if unheld:
        shown = shown_ids(list(dict.fromkeys(unheld)))
        named.append(f"job {job!r}: ids no node holds, never offered: {shown}")
    if named:
        raise ApiError(409, "never_offered", "; ".join(named), "ids")
    out: list[dict[str, Any]] = []
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
        out.append(answer)
    return out


async def route_ack(
    request: web.Request, job: str, ids: list[int], check: bool, local: LocalAck
) -> dict[str, Any]:
    """An ack whose ids name other nodes (node/core/ids.py): every node's
    ids are checked on that node first (``"check": true``), and only when
    all of them may be acked is each node's share acked. Raises ApiError:
    409 ``never_offered`` naming every id never offered (each node's
    refusal, and the ids of node numbers no node holds; nothing acked), 503
    ``peer_unavailable`` when a node holding some of the ids is down or does
    not answer (nothing acked), or when one fails between the two steps
    (then ``acked`` counts what was: acks are idempotent, the caller sends
    the same ack again; docs/delivery.md, "Acks in a fleet")."""
    fleet = _fleet(request.app)
    holders = await fleet.holders_or_503()
    groups: dict[int, list[int]] = {}
    for rid in ids:
        groups.setdefault(number_of(rid), []).append(rid)
    mine = {number for number, (peer, _live) in holders.items() if peer.name == fleet.name}
    local_ids = [rid for number in (0, *mine) for rid in groups.pop(number, [])]
    path = f"/jobs/{job}/ack"
    # Ids of a number no node holds were never offered; a down holder's are
    # checked nowhere: 503 after the others' checks, unless those are a 409.
    unheld = [rid for number, rids in groups.items() if number not in holders for rid in rids]
    down = [n for n in groups if n in holders and not holders[n][1]]
    remote = {holders[n][0]: rids for n, rids in groups.items() if n in holders and holders[n][1]}

    async def one(peer: Peer | None, rids: list[int], check_only: bool) -> dict[str, Any]:
        if peer is None:
            return await local(rids, check_only)
        answer = await fleet.ask(peer, path, {"ids": rids, "check": check_only})
        if answer.status == 200 and isinstance(answer.doc, dict):
            return answer.doc
        error = answer.doc.get("error") if isinstance(answer.doc, dict) else None
        if answer.status == 409 and isinstance(error, dict):
            raise ApiError(409, "never_offered", f"node {peer.name}: {error.get('message')}",
                           "ids")  # fmt: skip
        raise _unavailable(peer, answer)

    shares: list[tuple[Peer | None, list[int]]] = [(None, local_ids)] if local_ids else []
    shares += list(remote.items())
    checked = await _checked(job, [one(p, r, True) for p, r in shares], unheld)
    if down:
        raise ApiError(503, "peer_unavailable", f"node {holders[down[0]][0].name} holds ids "
                       f"such as {groups[down[0]][0]}, and it is down: its results wait on its "
                       "disk; retry once it is back")  # fmt: skip
    if check:
        return {"acked": 0, "checked": sum(int(c.get("checked", 0)) for c in checked)}
    done = await asyncio.gather(*(one(p, r, False) for p, r in shares), return_exceptions=True)
    acked = sum(int(d.get("acked", 0)) for d in done if isinstance(d, dict))
    failed = [d for d in done if isinstance(d, BaseException)]
    if failed:
        raise ApiError(503, "peer_unavailable", f"acked {acked}, then {failed[0]}: "
                       "send the same ack again (acks are idempotent)")  # fmt: skip
    return {"acked": acked}


__all__ = [
    "SCOPE",
    "Fleet",
    "Gathered",
    "Refused",
    "ask_node",
    "gather",
    "in_a_fleet",
    "not_summed",
    "poll_fleet",
    "route_ack",
]
