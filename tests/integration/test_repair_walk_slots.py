"""The repair walk after a doubt reads what the copy held at its start by
slot (keeper/verify.py: ``VerifyWalk.start_vers``, ``start_mins``, ``met``;
13 bytes a row; the buckets hold no str a key, keeper/_keys.c): a key the
copy lost after the start is set right by the walk's end, with a row the feed
wrote into its slot meanwhile; a version past 32 bits is copied whole."""

from __future__ import annotations

import sqlite3

import pytest

from keeper.process import Keeper
from keeper.verify import HELD
from node.core.rows import RowWrite
from node.store import open_store
from tests.integration.test_keeper import NOW, _config, _keeper_view, _rows, _table
from tests.integration.test_keeper_outage import _until, segments  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(120)


def test_a_key_lost_during_the_repair_walk_is_set_right_with_another_in_its_slot(
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
    assert walk is not None and walk.start_vers is not None
    assert walk.after is None and len(walk.met) == len(walk.start_vers)  # copied, not walked
    slot = keeper.buckets.slot_of(last)
    assert walk.met[slot] == HELD
    # The copy, after the start: the last key lost (as a fault would leave
    # it), and a row written since, which the feed enters into its slot.
    keeper.buckets.remove(last)
    store.upsert([RowWrite(key="zzz-written", route="pages", due_at=NOW)], now=NOW)
    t = _until(keeper, t, lambda: "zzz-written" in keeper.buckets, step=0.001)
    assert keeper.buckets.slot_of("zzz-written") == slot and keeper.buckets.slot_of(last) == -1
    assert keeper._verify is walk and not walk.table_done
    t = _until(keeper, t, lambda: keeper.exact, step=0.001)
    # The walk met the lost key in the table: held nowhere, so reconciled
    # (a dict by key would have taken it as the row held at the start).
    assert last in keeper.buckets and "zzz-written" in keeper.buckets
    assert keeper.stats.verify["last_repairs"] == 1
    assert _keeper_view(keeper) == _table(store)
    store.close()


def test_the_repair_walk_copies_versions_past_32_bits(
    segments,  # noqa: F811 - the fixture imported above
    node_name,
    tmp_path,
):
    """A store's versions are 64-bit (SQLite's rowids, PostgreSQL's bigint):
    a row written after 2**31 changes is walked like any other."""
    path = tmp_path / "schedule.db"
    store = open_store(f"sqlite:///{path}")
    store.upsert(_rows(100), now=NOW)
    conn = sqlite3.connect(path)
    with conn:
        assert conn.execute("UPDATE sqlite_sequence SET seq = 2147483647").rowcount
    conn.close()
    store.upsert(_rows(1, seed=7), now=NOW)
    keeper = Keeper(_config(node_name, tmp_path), store, *segments)
    keeper.start(NOW)
    t = _until(keeper, NOW, lambda: keeper.status == "live" and keeper.exact, step=0.01)
    assert max(version for *_, version in keeper.buckets.items()) >= 2**31
    keeper._feed_gap(keeper.feed_seq + 2, t)  # as a gap in the log would
    t = _until(keeper, t, lambda: keeper.exact, step=0.01)
    assert keeper.stats.verify["last_repairs"] == 0
    assert _keeper_view(keeper) == _table(store)
    store.close()
