"""One exception tree for the whole node.

Driver errors are wrapped once where they enter (``raise StoreError(...) from
exc``); callers above that point only ever see these names.
"""

from __future__ import annotations

from typing import Any


class NodeError(Exception):
    """Base of every error the node raises on purpose."""


class ConfigError(NodeError):
    """The configuration (file, environment or flags) is not valid.

    The message names the option, the value and what is allowed; ``source``
    says where the value came from (``file.toml:12``, ``QUEUE_NODE_LEASE_S``,
    ``--lease-s``).
    """

    def __init__(self, message: str, source: str | None = None) -> None:
        self.source = source
        super().__init__(f"{source}: {message}" if source else message)


class ValidationError(NodeError):
    """Something a caller sent is not valid. Maps to HTTP 400 / exit 2."""

    status = 400

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        self.code = code
        self.message = message
        self.field = field
        super().__init__(message)

    def to_json(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "field": self.field}}


class TooManyClasses(ValidationError):
    """A write would create more than ``max_classes`` classes."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__("too_many_classes", message, field)


class StoreError(NodeError):
    """The durable store failed (I/O, corruption, lost connection)."""


class StoreUnavailable(StoreError):
    """The store cannot be reached or opened."""


class UnsupportedStore(ConfigError):
    """The store URL names a backend this build does not have."""


class LayoutMismatch(NodeError):
    """A shared-memory segment exists with another layout version."""


class NodeNotRunning(NodeError):
    """No node of that name runs on this host (no segment, or its writer is dead)."""


class NodeRestarted(NodeError):
    """The tables a process attached belong to a node that has since stopped
    (sealed at its clean shutdown, or unlinked): nothing may be granted,
    renewed or released there. The caller reattaches to the new node's tables
    or answers ``503 node_restarted``."""


class NameTaken(ConfigError):
    """A name the node must own (a segment, a semaphore, a message queue, the
    ledger's socket) is held by another user or carries another data
    directory's identity. Refused at start: one line, exit 2."""


class WorkRefused(NodeError):
    """The work path refused a request it read (a claim, a renew or release
    of a lease, a completion): ``code`` is the stable error code of
    ``docs/api.md``, with ``message`` and the ``field`` it is about. The
    subclass says what kind of refusal it is; each interface answers it its
    own way (the HTTP workers with a status, ``LocalClaimer`` with a
    ``ClientError``)."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        self.code = code
        self.message = message
        self.field = field
        super().__init__(message)


class LeaseConflict(WorkRefused):
    """What the caller holds is not what the node has: the lease ended, was
    granted to another since, or is unknown; result ids never offered.
    Retrying the same request cannot succeed."""


class WorkUnavailable(WorkRefused):
    """The node cannot do it now (a lease slot busy, the ledger or its log
    unable to take results); the caller retries."""


class NotReady(WorkUnavailable):
    """No claim before the keeper's first publish since the node started."""

    def __init__(self, message: str) -> None:
        super().__init__("not_ready", message)


class NotGranting(WorkUnavailable):
    """The node's grant deadline has passed: it could not renew its fleet
    membership in time, so another node may own its rows by now, and it
    grants nothing until a heartbeat extends the deadline (docs/fleet.md)."""

    def __init__(self, message: str) -> None:
        super().__init__("not_granting", message)


class ClientError(NodeError):
    """The node refused a request (``node.client.Client`` over HTTP,
    ``node.local.LocalClaimer`` in shared memory, alike): ``status`` (the HTTP status), ``code``
    (the stable error code of ``docs/api.md``), ``message``, ``field``;
    ``body`` is the whole answer when there was one."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}" + (f" ({field})" if field else ""))
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.body = body
