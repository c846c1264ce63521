"""Who may make a node's SQLite store, and when.

A store that existed and is gone (its volume not mounted, its directory
renamed away, the file deleted) must never come back as a new, empty
schedule: every row would be lost without a word, and a keeper would serve
an empty queue and vouch for it. So:

- only the supervisor makes the file, at the node's start (``open_at_start``),
  and only when the data directory does not say a store was made there
  before. ``<data-dir>/store.json`` says it: ``{"url", "made_at", "how"}``
  (``how``: ``made``, or ``found`` for a store that was there when the
  first node with this data directory started);
- every other process of the node opens it without making it
  (``open_store(..., create=False)``, the default in a node's child): the
  keeper waits for it and says so in ``trust.store``, the others fail to
  start and are restarted with backoff;
- a start that finds the marker naming its store URL and no file is
  refused (``ConfigError``: one line, exit 2), naming the store and the
  marker: bring the store back, or remove the marker to start empty;
- ``python -m node import`` into a data directory's store follows the same
  rule (it may make a store a marker does not name; it never remakes one);
  with ``--store`` alone it has no data directory to ask.

A new data directory (or one renamed away with its store in it) has no
marker: its first start makes the store, as the first start of a node does.
A ``memory://`` store is not a file: none of this applies.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from node.core.errors import ConfigError
from node.store import Store, open_store

MARKER = "store.json"


def _path_of(url: str) -> str | None:
    """The SQLite file a URL names; None for a store that is not a file."""
    return url[len("sqlite:///") :] if url.startswith("sqlite:///") else None


def read_marker(data_dir: Path) -> dict[str, Any] | None:
    """The data directory's marker, or None when there is none (or it is not
    the JSON object this module writes: then it says nothing)."""
    try:
        doc = json.loads((Path(data_dir) / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _write_marker(data_dir: Path, url: str, how: str) -> None:
    marker = Path(data_dir) / MARKER
    tmp = marker.with_name(MARKER + ".tmp")
    tmp.write_text(json.dumps({"url": url, "made_at": time.time(), "how": how}) + "\n")
    os.replace(tmp, marker)


def refuse_if_gone(url: str, data_dir: Path) -> None:
    """ConfigError when the data directory says its store was made and the
    file is not there."""
    path = _path_of(url)
    if path is None or os.path.exists(path):
        return
    marker = read_marker(data_dir)
    if marker is None or marker.get("url") != url:
        return
    made_at = marker.get("made_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(made_at)) if made_at else "?"
    raise ConfigError(
        f"the store {path} is gone: {Path(data_dir) / MARKER} says this data directory's "
        f"store was made there ({when}); bring it back (a volume not mounted? a directory "
        f"renamed?), or remove {MARKER} to start on a new, empty store"
    )


def open_at_start(url: str, data_dir: Path) -> Store:
    """The supervisor's open at the node's start: the store, made when the
    data directory's rule allows (``refuse_if_gone``), and the marker
    written for a file store that has none naming it."""
    refuse_if_gone(url, data_dir)
    path = _path_of(url)
    existed = path is not None and os.path.exists(path)
    store = open_store(url, create=True)
    if path is not None:
        marker = read_marker(data_dir)
        if marker is None or marker.get("url") != url:
            try:
                _write_marker(data_dir, url, "found" if existed else "made")
            except OSError as exc:
                store.close()
                raise ConfigError(f"cannot write {Path(data_dir) / MARKER}: {exc}") from None
    return store
