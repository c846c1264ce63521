"""The lease file: what a clean shutdown saves of the lease table and the
next start loads (``LeaseTable.save`` and ``load``, table.py), at
``<data-dir>/leases.msgpack``.

A msgpack map: ``format`` (FILE_FORMAT), ``version`` (FILE_VERSION),
``saved_at``, ``next_lease_id``, ``counters`` (the lifetime counters, by
name) and ``entries``: one list per leased, held or parked key: the key's
bytes, its state code, the first eight fields of its record, then its
consumer, its last error and the row's version. Written atomically,
owner-only (the keys are the users' data).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgpack

from node.core.errors import NodeError
from shm.leases.protocol import (
    CONSUMER_BYTES,
    ERROR_BYTES,
    HELD,
    LEASED,
    PARKED,
    _key_bytes,
    _Record,
    truncated,
)

FILE_FORMAT = "queue-node.leases"
FILE_VERSION = 2


def write_lease_file(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` (FILE_FORMAT and FILE_VERSION added) to ``path``:
    a temporary file, fsynced, renamed over it, the directory fsynced."""
    doc = {"format": FILE_FORMAT, "version": FILE_VERSION, **doc}
    tmp = path.with_name(path.name + ".tmp")
    # Owner-only whatever the umask (the keys are the users' data).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgpack.packb(doc, use_bin_type=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_lease_file(path: Path) -> tuple[int, dict, list[tuple[bytes, int, _Record]]]:
    """(next lease id, counters, entries as (key, code, record)) of a file
    ``write_lease_file`` wrote; NodeError naming ``path`` for anything else."""
    try:
        doc = msgpack.unpackb(path.read_bytes(), raw=False)
        if doc.get("format") != FILE_FORMAT or doc.get("version") != FILE_VERSION:
            raise ValueError(
                f"format {doc.get('format')!r} version {doc.get('version')!r}, "
                f"expected {FILE_FORMAT!r} version {FILE_VERSION}"
            )
        entries = []
        for key, code, *fields, consumer, error, version in doc["entries"]:
            if code not in (LEASED, HELD, PARKED) or len(fields) != 8:
                raise ValueError(f"entry for {key!r}: state {code}, {len(fields)} fields")
            _key_bytes(key.decode())
            holder = truncated(consumer, CONSUMER_BYTES)
            message = truncated(error, ERROR_BYTES)
            rec = _Record._make([*fields, len(holder), len(message), holder, message, version])
            entries.append((bytes(key), code, rec))
        return int(doc["next_lease_id"]), dict(doc.get("counters") or {}), entries
    except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as exc:
        raise NodeError(f"{path} is not a lease file this node can load: {exc}") from exc
