"""The saved leases file carries live leases across a change of the lease
table's layout: the file has a version of its own, and a build reads the
files the build before it wrote.

``tests/data/leases-layout2.msgpack`` was written by the build with lease
table layout 2 (file version 2), saving a table with one live lease (600 s,
version 7) and one key released with an error (held): a clean stop of that
build, then this build's start.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from shm import leases as L
from shm.leases import LeaseTable, Outcome

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "leases-layout2.msgpack"
SAVED_AT = 1_800_000_002.0


def test_a_file_the_layout_2_build_saved_loads_into_this_layout(
    tmp_path: Path, node_name: str
) -> None:
    assert L.LAYOUT_VERSION != 2  # the table changed; the file did not need to
    path = tmp_path / "leases.msgpack"
    shutil.copy(FIXTURE, path)
    table = LeaseTable.create(node_name, capacity=64)
    try:
        assert table.load(path) == 2
        [lease] = table.live()
        assert (lease.key, lease.consumer) == ("https://example.com/leased", "gpu-0")
        assert lease.expires_at == 1_800_000_600.0
        outcome, held_lease = table.peek(lease.key, lease.lease_id)
        assert held_lease is not None and held_lease.version == 7  # the write-back's condition
        [hold] = table.held()
        assert hold.key == "https://example.com/held"
        counters = table.counters()
        assert (counters["grants"], counters["released"]) == (2, 1)
        # the live lease's holder completes it on the new build
        assert table.complete(lease.key, lease.lease_id, SAVED_AT + 10) == Outcome.COMPLETED
        assert table.counters()["completed"] == 1
    finally:
        table.close()
        LeaseTable.unlink(node_name)


def test_a_file_of_an_unknown_version_is_refused_not_guessed(
    tmp_path: Path, node_name: str
) -> None:
    import msgpack
    import pytest

    from node.core.errors import NodeError

    doc = msgpack.unpackb(FIXTURE.read_bytes())
    doc["version"] = 99
    path = tmp_path / "leases.msgpack"
    path.write_bytes(msgpack.packb(doc))
    table = LeaseTable.create(node_name, capacity=64)
    try:
        with pytest.raises(NodeError, match="version"):
            table.load(path)
        assert table.live() == []
    finally:
        table.close()
        LeaseTable.unlink(node_name)
