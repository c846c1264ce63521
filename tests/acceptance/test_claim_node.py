"""Acceptance: claimer processes against a real node never hold one key twice.

Eight processes claim through ``node.client.LocalClaimer`` (the ready set,
the shared claim cursor, the lease table) from a running node whose keeper
republishes as the set runs low, with every granted lease still live: each
due row must be granted exactly once. The keeper's publish leaves leased keys
out (detached from its class orders, ``keeper/buckets/detach.py``), so a key granted
twice would mean either that exclusion or the lease table's compare-and-swap
failed. 20,000 grants by default, 200,000 with ``--run-slow``.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter
from pathlib import Path

import msgpack
import pytest

from node.client import LocalClaimer
from node.core.rows import RowWrite
from node.store import open_store
from node.testing import NodeProcess, finish, wait_for

SPAWN = multiprocessing.get_context("spawn")
PROCS = 8
SEED_CHUNK = 10_000


@pytest.fixture
def node(tmp_path, node_name):
    proc = NodeProcess(
        tmp_path / "data", node_name, "--workers", "1",
        env={"QUEUE_NODE_LEASE_CAPACITY": str(1 << 18)},  # room for 200,000 live leases
    )
    yield proc
    finish([proc], node_name)


def _seed(data_dir: Path, rows: int) -> None:
    """Rows over three routes and both kinds, all due, written before the
    node starts (the keeper loads them)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    store = open_store(f"sqlite:///{data_dir / 'schedule.db'}")
    now = time.time()
    try:
        for start in range(0, rows, SEED_CHUNK):
            store.upsert(
                [
                    RowWrite(
                        key=f"item/{i:07d}",
                        route=f"r{i % 3}",
                        cadence_s=30 * 86400,
                        sitemap=i % 5 == 0,
                        due_at=now - 60 - (i % 7200),
                        payload=None,
                    )
                    for i in range(start, min(rows, start + SEED_CHUNK))
                ],
                now=now,
            )
    finally:
        store.close()


def _claim_loop(
    name: str, data_dir: str, index: int, total: int, go, first, out: str
) -> None:
    """Claim in small batches until the node's table has granted ``total``
    leases (every row once) or nothing more comes for a while; write the
    leases this process got. After its first grant each waits for every
    other's (``first``, a barrier): on 2 cores the first process scheduled
    could otherwise take all the rows before the others claim once."""
    got: list[tuple[str, int]] = []
    with LocalClaimer(name, data_dir=data_dir, consumer=f"c{index}") as local:
        go.wait(60)
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < 5.0:
            grants = local.claim(1 + index % 16, lease_s=3600, wait_s=0.2)
            if grants:
                if not got:
                    first.wait(60)
                got.extend((g.key, g.lease_id) for g in grants)
                idle_since = time.monotonic()
            elif local.leases.counters()["grants"] >= total:
                break
    Path(out).write_bytes(msgpack.packb(got))


def _exclusive_through_the_node(node: NodeProcess, tmp_path: Path, rows: int) -> None:
    _seed(node.data_dir, rows)
    node.start()
    wait_for(
        lambda: node.request("GET", "/readyz")[0] == 200, 30, "the keeper's first publish"
    )
    go, first = SPAWN.Event(), SPAWN.Barrier(PROCS)
    outs = [tmp_path / f"claims-{i}.msgpack" for i in range(PROCS)]
    children = [
        SPAWN.Process(
            target=_claim_loop,
            args=(node.name, str(node.data_dir), i, rows, go, first, str(out)),
        )
        for i, out in enumerate(outs)
    ]
    for child in children:
        child.start()
    go.set()
    for child in children:
        child.join(timeout=600)
    assert all(child.exitcode == 0 for child in children), [c.exitcode for c in children]
    grants = [tuple(g) for out in outs for g in msgpack.unpackb(out.read_bytes())]
    twice = [key for key, n in Counter(key for key, _ in grants).items() if n > 1]
    assert not twice, f"{len(twice)} keys granted twice while leased, first {twice[:5]}"
    assert len({lease_id for _, lease_id in grants}) == len(grants), "a lease id given twice"
    assert len(grants) == rows, f"{len(grants)} of {rows} rows granted"
    assert sum(1 for out in outs if msgpack.unpackb(out.read_bytes())) > 1, "one claimer took all"
    status, accounting = node.request("GET", "/accounting")
    assert status == 200
    assert accounting["routed"] == rows and accounting["in_flight"] == rows
    assert accounting["balanced"], accounting
    assert node.stop() == 0


@pytest.mark.timeout(240)
def test_eight_claimers_through_the_node_never_hold_one_key_twice(node, tmp_path):
    _exclusive_through_the_node(node, tmp_path, 20_000)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eight_claimers_through_the_node_never_hold_one_key_twice_200k(node, tmp_path):
    _exclusive_through_the_node(node, tmp_path, 200_000)
