"""Every host-wide name a node owns, computed in one place from its name.

Pure strings: nothing here opens, maps or checks a name (that is
``node/names.py``, the application layer's ``check_all``, ``holders`` and
``clear``). A node named N owns, on its host:

- ``/queue-node.N.ready``, ``.leases``, ``.state``: shared memory
  (``/dev/shm``), ``shm_segment_name(N, kind)``;
- ``/queue-node.N.wake``: a semaphore (``/dev/shm/sem.…``), ``wake_name``;
- ``/queue-node.N.ask``: the keeper's message queue, ``ask_queue_name``;
- ``/queue-node.N.reply.*``: an asker's reply queue, ``reply_queue_prefix``;
- ``\\0queue-node.N.ledger``: an abstract UNIX socket, ``ledger_address``;
- ``\\0queue-node.N.rows``: the row service's (a PostgreSQL node), ``rows_address``.

``shm_segment_name`` is not the completion log's ``segment_name(number)``
(a file in the data directory): a shared-memory segment is host-wide, a log
segment is a file of one node.
"""

from __future__ import annotations

import re
import socket

from node.core.errors import ConfigError

# Every name starts with this: /queue-node.<node>.<what>.
PREFIX = "queue-node"
# The shared-memory segments a node has, by kind.
SEGMENT_KINDS = ("ready", "leases", "state", "classes")
# A node name: what may sit between the dots of every name above.
NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_name(name: str) -> str:
    """``name`` when it is a valid node name; ConfigError otherwise."""
    if not NAME_RE.fullmatch(name):
        raise ConfigError(
            f"node name {name!r} is not valid: use [A-Za-z0-9._-], 1 to 64 characters"
        )
    return name


def host_node_name() -> str:
    """The default node name: the host name, cleaned to the allowed characters."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64]
    return name or "node"


def shm_segment_name(node: str, kind: str) -> str:
    """The host-wide name of ``node``'s shared-memory segment of ``kind``
    (one of SEGMENT_KINDS)."""
    return f"/{PREFIX}.{node}.{kind}"


def node_of_segment(name: str) -> str:
    """The node a ``shm_segment_name`` belongs to (for messages)."""
    return name.removeprefix(f"/{PREFIX}.").rsplit(".", 1)[0]


def wake_name(node: str) -> str:
    """The host-wide name of ``node``'s wake semaphore."""
    return f"/{PREFIX}.{node}.wake"


def ask_queue_name(node: str) -> str:
    """The keeper's ask queue (a POSIX message queue)."""
    return f"/{PREFIX}.{node}.ask"


def reply_queue_prefix(node: str) -> str:
    """The start of every asker's reply queue name (one queue an asker)."""
    return f"/{PREFIX}.{node}.reply."


def ledger_address(node: str) -> str:
    """The ledger's abstract socket name (a leading NUL: no file, no mode)."""
    return f"\0{PREFIX}.{node}.ledger"


def rows_address(node: str) -> str:
    """The row service's abstract socket name (a node on PostgreSQL:
    ``workers/rows``)."""
    return f"\0{PREFIX}.{node}.rows"


def owner_name(uid: int) -> str:
    """``uid 1000 (alice)``, for refusals naming who holds a name."""
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"
