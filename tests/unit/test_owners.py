"""Rendezvous ownership (keeper/owners.py): one owner a key, the same on every
node and build, an even share, and only the rows a membership change must move."""

from __future__ import annotations

import random

import pytest

from keeper import owners
from keeper.owners import MAX_NODES, Ownership

pytestmark = pytest.mark.timeout(60)


def _keys(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [
        f"https://shop-{rng.randrange(10**6)}.example/item/{i}?v={rng.random():.6f}"
        for i in range(n)
    ]


def test_the_definition_is_pinned():
    """Nodes of one fleet must agree whatever their build: a change of the hash,
    the mix or the tie rule moves rows between live nodes, so it fails here."""
    fleet = Ownership(["gpu-b", "gpu-a", "gpu-c"])
    keys = ["https://example.com/a", "https://example.com/b", "x", "y", "z", ""]
    keys += ["é", "k0", "k1", "k2"]
    assert [fleet.owner(k) for k in keys] == [
        "gpu-b",
        "gpu-c",
        "gpu-c",
        "gpu-b",
        "gpu-b",
        "gpu-c",
        "gpu-c",
        "gpu-b",
        "gpu-b",
        "gpu-a",
    ]
    assert owners.mix64(0) == 0
    assert owners.mix64(1) == 0x5692161D100B05E5
    assert owners.key_hash(b"x") == 0x4F586EF96743DF4A


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8])
def test_c_and_python_agree(count):
    if owners._claim is None:
        pytest.fail("the C extension is not built: python setup.py build_ext --inplace")
    fleet = Ownership([f"node-{i}" for i in range(count)])
    keys = _keys(5_000, seed=count)
    assert fleet.owner_indexes(keys) == bytes(fleet._owner_index_py(k) for k in keys)


def test_each_node_gets_an_even_share():
    fleet = Ownership(["n1", "n2", "n3"])
    indexes = fleet.owner_indexes(_keys(30_000))
    shares = [indexes.count(i) / len(indexes) for i in range(3)]
    assert all(abs(share - 1 / 3) < 0.02 for share in shares), shares


def test_a_node_joining_takes_keys_only_for_itself():
    keys = _keys(20_000)
    before = Ownership(["a", "b", "c"])
    after = Ownership(["a", "b", "c", "d"])
    moved = [(before.owner(k), after.owner(k)) for k in keys if before.owner(k) != after.owner(k)]
    assert all(new == "d" for _, new in moved)
    assert abs(len(moved) / len(keys) - 1 / 4) < 0.02
    # ... an even share from each of the others
    takers = {old: sum(1 for o, _ in moved if o == old) for old in "abc"}
    assert all(abs(n / len(moved) - 1 / 3) < 0.04 for n in takers.values()), takers


def test_a_node_leaving_hands_out_only_its_own_keys():
    keys = _keys(20_000)
    before = Ownership(["a", "b", "c", "d"])
    after = Ownership(["a", "b", "d"])
    for key in keys:
        if before.owner(key) != "c":
            assert after.owner(key) == before.owner(key)


def test_mine_is_the_keys_this_node_owns_and_the_nodes_partition_them():
    keys = _keys(6_000)
    names = ["east", "west", "north"]
    held = [Ownership(names, me=name).mine(keys) for name in names]
    assert sorted(k for part in held for k in part) == sorted(keys)
    assert all(
        Ownership(names, me=name).owns(k)
        for name, part in zip(names, held, strict=True)
        for k in part
    )
    assert Ownership(names).mine(keys) == []


def test_the_list_order_does_not_matter():
    keys = _keys(2_000)
    shuffled, ordered = Ownership(["c", "a", "b"]), Ownership(["a", "b", "c"])
    assert shuffled.owner_indexes(keys) == ordered.owner_indexes(keys)
    assert Ownership(["c", "a"], me="a") == Ownership(["a", "c"], me="a")


@pytest.mark.parametrize(
    "nodes, me, message",
    [
        ([], None, "at least one node"),
        (["a", "a"], None, "each node once"),
        ([f"n{i}" for i in range(MAX_NODES + 1)], None, "at most 255"),
        (["a", "b"], "c", "not in the node list"),
    ],
)
def test_a_bad_node_list_is_refused(nodes, me, message):
    with pytest.raises(ValueError, match=message):
        Ownership(nodes, me=me)
