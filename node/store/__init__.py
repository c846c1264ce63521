"""Store backends behind one interface (``node.store.base.Store``).

``open_store(url)`` picks the backend from the URL scheme:

- ``memory://`` — the in-memory twin, for unit tests;
- ``sqlite:///path/to/schedule.db`` — the embedded default;
- ``postgresql://user@host:port/db`` — the fleet backend (the ``fleet`` extra:
  psycopg 3 and psycopg_pool); ``docs/postgres.md``.
"""

from __future__ import annotations

import os
from typing import Any

# The URL's form is checked with the rest of the configuration (the core).
from node.core.config import check_store_url
from node.core.proc import ENV_SUPERVISOR
from node.store.base import BadRow, ClaimSource, LastError, Store, WriteBack

__all__ = [
    "BadRow",
    "ClaimSource",
    "LastError",
    "Store",
    "WriteBack",
    "open_store",
    "check_store_url",
    "is_fleet_url",
]


def is_fleet_url(url: str) -> bool:
    """Whether a node on this store is a fleet member (PostgreSQL): it
    joins the node list and grants only under a heartbeat (docs/fleet.md)."""
    return url.startswith(("postgresql://", "postgres://"))


def open_store(
    url: str,
    durable: bool = True,
    autocheckpoint: bool = True,
    busy_timeout_s: float | None = None,
    create: bool | None = None,
    node_name: str | None = None,
    network_timeout_s: float | None = None,
    cache_kib: int | None = None,
) -> Store:
    """``durable``: each commit synced to disk (SQLite FULL, PostgreSQL
    ``synchronous_commit``), else not (``Store.sync`` does it);
    ``autocheckpoint`` False: commits never checkpoint the WAL (the caller
    does, ``Store.checkpoint_wal``); ``busy_timeout_s`` (SQLite): how long a
    statement waits for another connection's lock (None: the default, 5 s);
    ``node_name`` (PostgreSQL): whose meta the store keeps (the host's node
    name by default); ``network_timeout_s`` (PostgreSQL): a connection
    whose server stops answering fails within about this long (default
    about 10 s); ``cache_kib`` (SQLite): the connection's page cache (None:
    16 MiB, ``sqlite.CACHE_KIB``).

    ``create`` (SQLite): make a missing file (and its directory), or raise
    StoreUnavailable. None: make it, except in a node's child process (one
    started by a supervisor: ``QUEUE_NODE_SUPERVISOR_PID`` is set), which
    never does: a node's store is made only by its supervisor at start,
    by the data directory's rule (``node.store.made``), so a store that went
    away while the node ran is never replaced by an empty one."""
    check_store_url(url)
    if create is None:
        create = not os.environ.get(ENV_SUPERVISOR)
    if url.startswith("memory://"):
        from node.store.memory import MemoryStore

        return MemoryStore(url)
    if is_fleet_url(url):
        from node.store.postgres import PostgresStore

        return PostgresStore(
            url, durable=durable, node_name=node_name, network_timeout_s=network_timeout_s
        )
    from node.store.sqlite import SQLiteStore

    # sqlite:///relative.db and sqlite:////absolute.db, as SQLAlchemy spells them.
    path = url[len("sqlite:///") :]
    tuning: dict[str, Any] = {}
    if busy_timeout_s is not None:
        tuning["busy_timeout_s"] = busy_timeout_s
    if cache_kib is not None:
        tuning["cache_kib"] = cache_kib
    return SQLiteStore(path, durable, autocheckpoint, create=create, **tuning)
