"""Shared helpers for the bench scripts: seeding a schedule file quickly, and
the ``--json PATH`` option that ``python -m bench`` reads each script's
figures from."""

from __future__ import annotations

import argparse
import json
import math
import random
import sqlite3
import time
from pathlib import Path
from typing import Any

ROUTES = [f"route{i:02d}" for i in range(20)]
CADENCES = [None, None, 900, 3600, 86400, 604800]


def key_of(i: int) -> str:
    """A key of about 55 characters, like a real item URL."""
    return f"https://example.com/items/{i:010d}/some-slug-text-{i % 97:02d}"


def seed(path: Path, rows: int, now: float, seed_value: int = 1) -> Path:
    """A schedule file with ``rows`` rows (about 100 classes, due times over
    30 days, a third of them due). Made once per size and reused."""
    from node.store import open_store

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        conn = sqlite3.connect(path)
        try:
            if conn.execute("SELECT count(*) FROM schedule").fetchone()[0] == rows:
                return path
        finally:
            conn.close()
        for suffix in ("", "-wal", "-shm"):
            Path(str(path) + suffix).unlink(missing_ok=True)
    store = open_store(f"sqlite:///{path}")
    from node.core.rows import RowWrite

    rnd = random.Random(seed_value)
    t0 = time.perf_counter()
    batch = []
    for i in range(rows):
        batch.append(
            RowWrite(
                key=key_of(i),
                route=rnd.choice(ROUTES),
                cadence_s=rnd.choice(CADENCES),
                sitemap=rnd.random() < 0.3,
                due_at=now + rnd.uniform(-10 * 86400, 20 * 86400),
            )
        )
        if len(batch) == 10_000:
            store.upsert(batch, now=now)
            batch = []
    if batch:
        store.upsert(batch, now=now)
    store.trim_changes(store.last_seq())
    store.close()
    print(f"seeded {rows} rows in {time.perf_counter() - t0:.1f} s -> {path}", flush=True)
    return path


# -- --json PATH: what a script printed, for python -m bench -----------------------------

_KEPT: list[dict] = []


def reusable(path: Path, rows: int) -> bool:
    """Whether the template schedule at ``path`` holds ``rows`` rows; when it
    does not (or cannot be read), its files are removed for a new seeding."""
    if path.exists():
        conn = sqlite3.connect(path)
        try:
            if conn.execute("SELECT count(*) FROM schedule").fetchone()[0] == rows:
                return True
        except sqlite3.Error:
            pass
        finally:
            conn.close()
        for suffix in ("", "-wal", "-shm"):
            Path(str(path) + suffix).unlink(missing_ok=True)
    return False


def finish_template(store: Any, path: Path, rows: int, t0: float) -> Path:
    """A seeded template made ready to copy: its change log trimmed, the
    store closed, the WAL folded into the file; says how long it took."""
    store.trim_changes(store.last_seq())
    store.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    print(f"seeded {rows} rows in {time.perf_counter() - t0:.1f} s -> {path}", flush=True)
    return path


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write every result printed, as one JSON list, to PATH (python -m bench)",
    )


def keep(doc: dict) -> dict:
    """Keeps a result for ``--json`` (the script still prints it as before)."""
    _KEPT.append(doc)
    return doc


def write_json(path: Path | None) -> None:
    """Writes the results kept so far to ``path`` (nothing when ``None``)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_KEPT, indent=1, default=str) + "\n")


def percentile(ordered: list[float], q: float) -> float | None:
    """The q-quantile of sorted values (nearest rank), or None when empty."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

