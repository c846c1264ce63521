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
    verification finds and repairs it: ``drop`` a key, ``move`` it 10,000
    minutes later, or add a ``phantom`` row the table does not have."""
    key = str(request.get("key"))
    mode = request.get("mode")
    buckets = keeper.buckets
    held = buckets.get(key)
    if mode == "drop" and held is not None:
        buckets.remove(key)
    elif mode == "move" and held is not None:
        minute, cid, version = held
        info = keeper.classes.info(cid)
        buckets.remove(key)
        own_cadence = info.cadence_s if info.source == SOURCE_ROW else None
        buckets.apply(key, version, info.route, own_cadence, info.sitemap, (minute + 10_000) * 60.0)
    elif mode == "phantom":
        buckets.apply(key, 1, "phantom", None, False, 0.0)
    else:
        return {"ok": False}
    return {"ok": True}
