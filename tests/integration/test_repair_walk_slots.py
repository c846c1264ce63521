"""The repair walk after a doubt reads what the copy held at its start by
slot (keeper/verify.py: ``VerifyWalk.start``, 9 bytes a row; the buckets hold
no str a key, keeper/_keys.c): a key the copy lost after the start, and
another key that took its slot, are both set right by the walk's end."""

from __future__ import annotations

import pytest

from keeper.process import Keeper
from node.store import open_store
from tests.integration.test_keeper import NOW, _config, _keeper_view, _rows, _table
from tests.integration.test_keeper_outage import _until, segments  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(120)


def test_a_slot_taken_by_another_key_during_the_repair_walk_is_set_right(
    segments,  # noqa: F811 - the fixture imported above
    node_name,
    tmp_path,
):
    store = open_store(f"sqlite:///{tmp_path / 'schedule.db'}")
    store.upsert(_rows(25_000), now=NOW)
    keeper = Keeper(_config(node_name, tmp_path), store, *segments)
    keeper.start(NOW)
    t = _until(keeper, NOW, lambda: keeper.status == "live" and keeper.exact, step=0.01)
    last = max(key for key, *_ in keeper.buckets.items())  # met by the walk's last chunk
    keeper._feed_gap(keeper.feed_seq + 2, t)  # as a gap in the log would
    t = _until(keeper, t, lambda: keeper._verify is not None and keeper._verify.filling is None,
               step=0.001)  # fmt: skip
    walk = keeper._verify
    assert walk is not None and walk.start is not None
    assert walk.after is None and len(walk.met) == len(walk.start)  # copied, not walked yet
    slot = keeper.buckets.slot_of(last)
    assert walk.start[slot] >= 0
    # The copy, after the start: the last key lost, another in its slot.
    keeper.buckets.remove(last)
    keeper.buckets.apply("zzz-planted", 1, "pages", None, False, NOW)
    assert keeper.buckets.slot_of("zzz-planted") == slot and keeper.buckets.slot_of(last) == -1
    t = _until(keeper, t, lambda: keeper.exact, step=0.001)
    assert last in keeper.buckets and "zzz-planted" not in keeper.buckets
    assert keeper.stats.verify["last_repairs"] == 2
    assert _keeper_view(keeper) == _table(store)
    store.close()
