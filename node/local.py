"""``LocalClaimer``: claims for processes on a node's host.

For the inference processes and a local GPU worker: claims come straight
from the node's shared memory through ``workers.claim.Claimer`` (no network
hop), completions go to the ledger over its local socket. The rules are the
HTTP endpoints' rules (``workers.claim.rules``), and a refusal raises the
same ``ClientError`` (status and code) that the HTTP answer would. It is
also importable as ``node.client.LocalClaimer``, the contract's path.

How LocalClaimer finds the node: it needs the node's resolved configuration
(the store URL, the routes' cadences), which the supervisor writes to
``<data-dir>/run/config.json``. It looks, in order, at ``data_dir`` if given,
``$QUEUE_NODE_RUN_CONFIG`` (set for every process the supervisor starts),
``$QUEUE_NODE_DATA_DIR``, then the node of that name running on this host
(its supervisor's pid is in its state buffer, and the supervisor gives every
process it starts the configuration's path), then ``./node-data`` (the
default data directory), and uses the first whose configuration names this
node. Anything else: ``NodeNotRunning`` saying where it looked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.core.config import Config
from node.core.errors import (
    ClientError,
    LeaseConflict,
    NodeError,
    NodeNotRunning,
    NodeRestarted,
    NotGranting,
    NotReady,
    StoreError,
    ValidationError,
    WorkRefused,
)
from node.core.names import ledger_address
from node.core.proc import ENV_CONFIG, ENV_SUPERVISOR
from node.core.rows import Grant, check_key, result_bytes
from shm.leases import SlotTakenOver
from workers.claim import (
    Claimer,
    check_claim,
    check_lease_id,
    check_lease_s,
    complete_outcome,
    ledger_error,
    refuse,
)
from workers.rows import RowsClient

if TYPE_CHECKING:
    from shm.leases import Outcome

# A LocalClaimer waiting for a publish looks at its node's seal this often.
RESTART_CHECK_S = 0.25
ENV_DATA_DIR = "QUEUE_NODE_DATA_DIR"
DEFAULT_DATA_DIR = Path("node-data")


def find_config(name: str, data_dir: str | os.PathLike[str] | None = None) -> Config:
    """The running node's resolved configuration (see the module docstring)."""
    tried: list[Path] = []
    for path, running in _candidates(name, data_dir):
        tried.append(path)
        config = _config_at(path, name)
        if config is None:
            continue
        if running and not config.data_dir.is_absolute():
            # Written as the node was given it, relative to the node's
            # directory: the data directory is where this file lies.
            config = dataclasses.replace(config, data_dir=path.resolve().parent.parent)
        return config
    tried_text = ", ".join(map(str, tried))
    raise NodeNotRunning(
        f"no run configuration of node {name!r} found (tried {tried_text}); pass data_dir= "
        "the node's --data-dir"
    )


def _candidates(name: str, data_dir: str | os.PathLike[str] | None) -> Iterator[tuple[Path, bool]]:
    """Where ``find_config`` looks, in order, each with whether it is the
    running node's; made as asked, so the running node (its processes'
    environments) is looked for only when the places before name none."""
    if data_dir is not None:
        yield Path(data_dir) / "run" / "config.json", False
        return
    if os.environ.get(ENV_CONFIG):
        yield Path(os.environ[ENV_CONFIG]), False
    if os.environ.get(ENV_DATA_DIR):
        yield Path(os.environ[ENV_DATA_DIR]) / "run" / "config.json", False
    running = _running_config(name)
    if running is not None:
        yield running, True
    yield DEFAULT_DATA_DIR / "run" / "config.json", False


def _config_at(path: Path, name: str) -> Config | None:
    """The configuration in ``path`` when it is node ``name``'s."""
    try:
        config = Config.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return config if config.name == name else None


def _running_config(name: str) -> Path | None:
    """The configuration path of the node ``name`` running here as this
    user, or None. Its state buffer's header (this user's segment only, read
    without mapping it) names its supervisor, which starts every process of
    the node with ``$QUEUE_NODE_RUN_CONFIG`` and its own pid in
    ``$QUEUE_NODE_SUPERVISOR_PID``; only a child of this user's that names
    that supervisor counts. What the path holds is checked by the caller
    (the name), and the segments by ``_attach`` (this user's, with this data
    directory's identity)."""
    import psutil

    from node.core.names import NAME_RE, shm_segment_name
    from shm.segment import owner_pid_of
    from shm.state import KIND

    if not NAME_RE.fullmatch(name):
        return None  # no node has that name (and posix_ipc must never see it)
    supervisor = owner_pid_of(shm_segment_name(name, KIND))
    if supervisor is None:
        return None
    try:
        children = psutil.Process(supervisor).children()
    except psutil.Error:
        return None
    uid = os.getuid()
    for child in children:
        try:  # a child may exit meanwhile (a worker restarted): the next one
            if child.uids().real != uid:
                continue
            env = child.environ()
        except psutil.Error:
            continue
        if env.get(ENV_SUPERVISOR) == str(supervisor) and env.get(ENV_CONFIG):
            return Path(env[ENV_CONFIG])
    return None


def refusal(exc: WorkRefused | ValidationError) -> ClientError:
    """A refusal of the work path as the ClientError the HTTP answer would
    make of it: the same code, and the same status (what the caller sent is
    not valid: 400; the lease or the ids are not what the caller holds: 409;
    the node cannot do it now: 503, retry)."""
    if isinstance(exc, ValidationError):
        status = 400
    elif isinstance(exc, LeaseConflict):
        status = 409
    else:
        status = 503
    return ClientError(status, exc.code, exc.message, exc.field)


def _encode(result: Any) -> tuple[bytes, str]:
    """A result as the ledger takes it: bytes raw, anything else as JSON text
    (``result_bytes``: what JSON or msgpack cannot carry is refused)."""
    try:
        return result_bytes(result)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ClientError(400, "invalid_result", f"not a JSON value: {exc}", "result") from None


def _check_lease(lease_id: Any, key: Any) -> None:
    try:
        check_lease_id(lease_id)
        check_key(key)
    except ValidationError as exc:
        raise refusal(exc) from None


class LocalClaimer:
    """Claims straight from the shared memory of node ``name`` on this host.

    One per thread (a claim is not thread-safe). ``close()`` when done: it
    unmaps the segments and closes the store and the ledger connection;
    nothing is unlinked (only the supervisor does that).

    Across restarts of the node: a clean stop seals the lease table before it
    saves the leases, so nothing can be granted, renewed or released in it
    any more. A call that meets the seal (or finds nothing to claim in a
    sealed table) reattaches to the new node's segments, told apart by their
    boot id, and goes on there; while no new node is up it raises
    ``ClientError(503, "node_restarted")`` and tries again at the next call.
    After a kill -9 the restarted node reattaches the same segments, which
    are not sealed: an attached claimer goes on as it was.

    On a node whose store is PostgreSQL the claimer reads its rows through
    the node's row service (``workers/rows``): this process holds no
    PostgreSQL connection. A claim whose rows cannot be read (the service
    restarting, the server away) grants nothing and raises
    ``ClientError(503, "store_unavailable")``; the next claim tries again.
    """

    def __init__(
        self,
        name: str,
        data_dir: str | os.PathLike[str] | None = None,
        consumer: str | None = None,
    ) -> None:
        from node.ipc import IpcClient

        self.name = name
        self._data_dir = data_dir
        self.consumer = consumer or f"local-{os.getpid()}"
        self._opened: list[Any] = []
        self._attach()
        self.ledger = IpcClient(ledger_address(name))

    def _attach(self) -> None:
        """Map the node's segments and open its store; ``boot_id`` is the
        boot these belong to. Raises NodeNotRunning (or NameTaken for names
        that are not this user's node's)."""
        from node.core.identity import data_dir_id
        from node.store import is_fleet_url, open_store
        from shm.leases import LeaseTable
        from shm.ready import ReadySet
        from shm.state import StateBuffer, boot_id
        from shm.wake import Wake

        self.config = find_config(self.name, self._data_dir)
        ident = data_dir_id(self.config.data_dir)
        try:
            self.state = self._open(StateBuffer.attach(self.name, data_dir_id=ident))
            self.boot_id = boot_id(self.state.segment)
            self.ready = self._open(ReadySet.attach(self.name))
            self.leases = self._open(LeaseTable.attach(self.name))
            self.wake = self._open(Wake.attach(self.name))
            # The running node's store: never made here (node/store/made.py).
            # On PostgreSQL its rows come through the node's row service
            # (workers/rows): this process holds no connection of its own.
            if is_fleet_url(self.config.store_url):
                self.store = self._open(RowsClient(self.name))
            else:
                self.store = self._open(
                    open_store(self.config.store_url, create=False, node_name=self.config.name)
                )
        except BaseException:
            self._detach()
            raise
        self.claimer = Claimer(
            self.config,
            self.store,
            self.ready,
            self.leases,
            wake=self.wake.post,
            is_ready=self._keeper_published,
        )

    def _detach(self) -> None:
        while self._opened:
            try:
                self._opened.pop().close()
            except (OSError, BufferError, NodeError):
                pass  # a mapping of a node that is gone: nothing to flush

    def _open(self, obj: Any) -> Any:
        self._opened.append(obj)
        return obj

    def _restarted(self) -> bool:
        """Whether the node these segments belong to has stopped (sealed at
        its clean stop), or its names now lead elsewhere (a restart after a
        kill -9 that had to make a segment anew, say for a new ready_size)."""
        if not self._opened:
            return False
        if self.leases.sealed:
            return True
        return not all(seg.segment.still_named() for seg in (self.state, self.ready, self.leases))

    def _reattach(self) -> None:
        """Move to the new node's segments, or ClientError 503 node_restarted
        while there is none (or only the old one's, sealed, still named)."""
        old_boot = getattr(self, "boot_id", None)
        self._detach()
        try:
            self._attach()
        except NodeError as exc:
            raise ClientError(
                503, "node_restarted",
                f"node {self.name!r} restarted and no new node is up yet: {exc}",
            ) from None  # fmt: skip
        if self.leases.sealed or self.boot_id == old_boot:
            self._detach()
            raise ClientError(
                503,
                "node_restarted",
                f"node {self.name!r} is stopping; its next start is not up yet",
            )

    def _current(self) -> None:
        """Reattach first when the last call found the node gone."""
        if not self._opened:
            self._reattach()

    def _keeper_published(self) -> bool:
        state = self.state.read()
        first = state.get("first_publish_at") or 0.0
        return first > 0 and first >= state.get("started_at", 0.0)

    def claim(
        self,
        max: int,
        lease_s: float | None = None,
        consumer: str | None = None,
        wait_s: float = 0.0,
    ) -> list[Grant]:
        """Up to ``max`` leases, most overdue first. With ``wait_s``, a claim
        that finds nothing waits for the keeper's next publish (up to
        ``wait_s`` in all) and tries again."""
        try:
            max_n, lease_s, consumer = check_claim(
                max, self.config.lease_s if lease_s is None else lease_s, consumer or self.consumer
            )
        except ValidationError as exc:
            raise refusal(exc) from None
        deadline = time.monotonic() + wait_s
        self._current()
        while True:
            generation = self.claimer.generation
            try:
                grants = self.claimer.claim(max_n, lease_s, consumer, time.time())
            except NotReady as exc:
                if self._restarted():
                    self._reattach()
                    continue
                raise refusal(exc) from None
            except NotGranting as exc:  # a fleet's node that could not renew its membership
                raise refusal(exc) from None
            except StoreError as exc:
                # The rows could not be read (on PostgreSQL: the server, or
                # the node's row service, cannot be reached): nothing was
                # granted; the HTTP answer's 503, retry.
                raise ClientError(503, "store_unavailable", str(exc)) from None
            except (NodeRestarted, SlotTakenOver):
                # SlotTakenOver: a stop of the node took back a slot this
                # process held past the seal's deadline (stopped meanwhile).
                if not self._restarted():
                    raise
                self._reattach()
                continue
            if not grants and self._restarted():
                self._reattach()
                continue
            left = deadline - time.monotonic()
            if grants or left <= 0:
                return grants
            # In slices: a node that stops publishes nothing more, and a
            # waiter must notice the seal.
            self.claimer.wait_for_publish(generation, min(left, RESTART_CHECK_S))

    def complete(self, lease_id: int, key: str, result: Any) -> int:
        """Hand in a lease's result (bytes or a JSON value), answered once it
        is durable; the result id."""
        (answer,) = self.complete_many([(lease_id, key, result)])
        if isinstance(answer, ClientError):
            raise answer
        return answer

    def complete_many(self, items: list[Any]) -> list[int | ClientError]:
        """Several results ``(lease_id, key, result)`` (or dicts of the
        three, as ``Client.complete_many`` takes them) in one ledger request
        (they share one group commit): per item, its result id or the
        ClientError ``complete`` would raise. Raises ClientError (400) when an
        item is malformed (nothing is sent), and 503 ``ledger_unavailable``
        when the ledger cannot be reached (nothing is known to be accepted),
        or ``node_restarted`` when its node has stopped (send them again)."""
        from node.core.rows import completions
        from node.ipc import IpcError, RemoteError

        items = completions(items)
        request = []
        for lease_id, key, result in items:
            _check_lease(lease_id, key)
            data, encoding = _encode(result)
            request.append({"lease_id": lease_id, "key": key, "result": data, "encoding": encoding})
        if not request:
            return []
        try:
            answer = self.ledger.call("complete", items=request)
        except IpcError as exc:
            # Not attached: an earlier call found the node stopped and no
            # new one up (``_reattach``); still so, most likely.
            if not self._opened or self._restarted():
                raise ClientError(
                    503, "node_restarted", f"node {self.name!r} restarted: {exc}; send it again"
                ) from None
            raise ClientError(503, "ledger_unavailable", str(exc)) from None
        except RemoteError as exc:
            raise refusal(ledger_error(exc.code, exc.message)) from None
        outcomes = answer.get("outcomes") or []
        if len(outcomes) != len(request):
            raise ClientError(503, "ledger_unavailable", "the ledger answered the wrong count")
        out: list[int | ClientError] = []
        for (_lease_id, key, _result), outcome in zip(items, outcomes, strict=True):
            try:
                out.append(complete_outcome(outcome, key))  # type: ignore[arg-type]
            except WorkRefused as exc:
                out.append(refusal(exc))
        return out

    def release(self, lease_id: int, key: str, error: str | None = None) -> None:
        _check_lease(lease_id, key)
        if error is not None and not isinstance(error, str):
            raise ClientError(400, "invalid_error", "error must be a string (or None)", "error")
        outcome = self._on_current(lambda: self.claimer.release(key, lease_id, time.time(), error))
        if outcome.value != "released":
            raise refusal(refuse(outcome, key))

    def renew(self, lease_id: int, key: str, lease_s: float) -> float:
        """The lease's new expires_at."""
        _check_lease(lease_id, key)
        try:
            lease_s = check_lease_s(lease_s)
        except ValidationError as exc:
            raise refusal(exc) from None
        now = time.time()
        outcome = self._on_current(lambda: self.claimer.renew(key, lease_id, lease_s, now))
        if outcome.value != "renewed":
            raise refusal(refuse(outcome, key))
        return now + lease_s

    def _on_current(self, change: Callable[[], Outcome]) -> Outcome:
        """Run a lease change in the current node's table: one that meets the
        seal of a stopped node runs again in the new node's (its leases were
        saved and loaded there), never in the old one."""
        self._current()
        try:
            return change()
        except (NodeRestarted, SlotTakenOver):
            if not self._restarted():
                raise
            self._reattach()
            return change()

    def close(self) -> None:
        ledger = getattr(self, "ledger", None)
        if ledger is not None:
            ledger.close()
        self._detach()

    def __enter__(self) -> LocalClaimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
