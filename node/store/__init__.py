"""Store backends behind one interface (``node.store.base.Store``).

``open_store(url)`` picks the backend from the URL scheme:

- ``memory://`` — the in-memory twin, for unit tests;
- ``sqlite:///path/to/schedule.db`` — the embedded default;
- ``postgresql://…`` — the fleet backend, not in this build yet.
"""

from __future__ import annotations

from node.core.errors import UnsupportedStore
from node.store.base import BadRow, ClaimSource, Store

__all__ = ["BadRow", "ClaimSource", "Store", "open_store", "check_store_url"]


def check_store_url(url: str) -> str:
    """Validate a store URL before anything starts; returns it unchanged."""
    if url.startswith("memory://"):
        return url
    if url.startswith("sqlite:///"):
        if len(url) == len("sqlite:///"):
            raise UnsupportedStore(f"store URL {url!r} names no file")
        return url
    if url.startswith(("postgresql://", "postgres://")):
        raise UnsupportedStore(
            "the PostgreSQL fleet backend is not available in this build yet; "
            "use sqlite:///<file> (the default)"
        )
    raise UnsupportedStore(
        f"unknown store URL {url!r}: expected sqlite:///<file> or postgresql://…"
    )


def open_store(url: str) -> Store:
    check_store_url(url)
    if url.startswith("memory://"):
        from node.store.memory import MemoryStore

        return MemoryStore(url)
    from node.store.sqlite import SQLiteStore

    # sqlite:///relative.db and sqlite:////absolute.db, as SQLAlchemy spells them.
    return SQLiteStore(url[len("sqlite:///") :])
