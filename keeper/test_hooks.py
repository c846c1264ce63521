"""Test hooks of the keeper, imported only when the node runs with
``QUEUE_NODE_TEST_HOOKS=1`` (the keeper's ``corrupt`` question): nothing here
is on a production path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from node.core.classes import SOURCE_ROW

if TYPE_CHECKING:
    from keeper.process import Keeper


def corrupt(keeper: Keeper, request: dict[str, Any]) -> dict[str, Any]:
    """Make the keeper's view wrong on purpose, so a test can prove that
    verification finds and repairs it: ``drop`` a key, ``move`` it
    ``minutes`` later (10,000 unless the request says; a negative number
    moves it earlier, so that a key the table has due later heads the next
    publish), or add a ``phantom`` row the table does not have (due since
    the epoch: it heads the next publish too).

    A planted entry is not an occurrence: ``received`` (the buckets'
    ``came_due``) is left as it was, so the input law shows only what the
    plant took away (docs/accounting.md)."""
    key = str(request.get("key"))
    mode = request.get("mode")
    minutes = request.get("minutes", 10_000)
    if isinstance(minutes, bool) or not isinstance(minutes, int):
        return {"ok": False}
    buckets = keeper.buckets
    held = buckets.get(key)
    came_due = buckets.came_due
    if mode == "drop" and held is not None:
        buckets.remove(key)
    elif mode == "move" and held is not None:
        minute, cid, version = held
        info = keeper.classes.info(cid)
        buckets.remove(key)
        own_cadence = info.cadence_s if info.source == SOURCE_ROW else None
        due_at = max(0, minute + minutes) * 60.0
        buckets.apply(key, version, info.route, own_cadence, info.sitemap, due_at)
    elif mode == "phantom":
        buckets.apply(key, 1, "phantom", None, False, 0.0)
    else:
        return {"ok": False}
    buckets.came_due = came_due
    return {"ok": True}
