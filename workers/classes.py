"""Class identities of writes, for the ``max_classes`` check.

A class is route × effective cadence × cadence source × sitemap flag (see
DESIGN.md). The keeper owns the class table; a worker only needs to know which
classes a write *would* create, before anything is written, so it can refuse
the write whole (``too_many_classes``). The HTTP API and the importer both
check here, so they refuse the same writes.

An update that does not carry ``cadence_s`` or ``sitemap`` keeps the stored
value, so the caller passes the stored rows of those keys (``needs_stored``
says which keys those are).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from node.core.classes import ClassId
from node.core.classes import class_id as core_class_id
from node.core.config import Config
from node.core.errors import TooManyClasses
from node.core.rows import MISSING, Row, RowWrite


def class_id(config: Config, route: str, cadence_s: int | None, sitemap: bool) -> ClassId:
    """The class a row would be in under ``config`` (node/core/classes.py)."""
    return core_class_id(route, cadence_s, sitemap, config.route(route).cadence_s)


def needs_stored(writes: Iterable[RowWrite]) -> list[str]:
    """Keys whose class depends on the stored row (the write leaves a
    class-defining field as it is)."""
    return [w.key for w in writes if w.cadence_s is MISSING or w.sitemap is MISSING]


def write_classes(
    config: Config, writes: Sequence[RowWrite], stored: Mapping[str, Row | Any]
) -> set[ClassId]:
    """The classes the rows of a batch end up in, applying the writes in order
    (a later write of a key in the batch updates what an earlier one set).

    ``stored`` maps keys to their stored ``Row``; a key absent from it (or
    mapped to something that is not a Row, such as an unreadable ``BadRow``)
    is an insert, whose missing fields take the defaults (cadence from the
    route, sitemap false).
    """
    state: dict[str, tuple[str, int | None, bool]] = {}
    for w in writes:
        before = state.get(w.key)
        if before is None:
            row = stored.get(w.key)
            if isinstance(row, Row):
                before = (row.route, row.cadence_s, row.sitemap)
            else:
                before = (w.route, None, False)
        cadence = before[1] if w.cadence_s is MISSING else w.cadence_s
        sitemap = before[2] if w.sitemap is MISSING else w.sitemap
        state[w.key] = (w.route, cadence, sitemap)
    return {class_id(config, r, c, s) for r, c, s in state.values()}


def check_class_limit(
    known: set[ClassId], batch: set[ClassId], max_classes: int, field: str | None = "rows"
) -> None:
    """Refuse a write that would take the node past ``max_classes``.

    Only a write that brings a new class can be refused: a write into
    classes that exist already creates nothing, even if the node is over the
    limit (after a configuration change lowered it)."""
    new = batch - known
    if not new:
        return
    total = len(known) + len(new)
    if total > max_classes:
        raise TooManyClasses(
            f"this write would make {total} classes ({len(new)} new); "
            f"at most {max_classes} allowed (max_classes)",
            field,
        )


def classes_from_state(state: Mapping[str, Any] | None) -> set[ClassId]:
    """The class identities the keeper reports in its state document
    (``doc["classes"]``). Malformed entries are skipped: a partial answer only
    makes the check more lenient, and the keeper refuses what it cannot hold."""
    if not state:
        return set()
    doc = state.get("doc")
    rows = doc.get("classes") if isinstance(doc, Mapping) else None
    out: set[ClassId] = set()
    if not isinstance(rows, list):
        return out
    for c in rows:
        try:
            out.add((str(c["route"]), int(c["cadence_s"]), str(c["source"]), bool(c["sitemap"])))
        except (KeyError, TypeError, ValueError):
            continue
    return out
