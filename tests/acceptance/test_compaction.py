"""Acceptance: the ledger removes segments whose results are all retired.

A real node with small segments (``log_segment_bytes``): results fill several
segment files; once every result is acknowledged, the ledger's compaction
removes all but the active segment, and a restart recovers to the same
accounts (the removed segments' counts live on in the checkpoint)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from node.client import Client
from node.testing import NodeProcess, finish, wait_for

pytestmark = pytest.mark.timeout(120)

ITEMS = 120
RESULT = "x" * 400  # about 50 results to a 16 KiB segment


@pytest.fixture
def node(tmp_path, node_name):
    proc = NodeProcess(
        tmp_path / "data", node_name, "--workers", "1",
        env={"QUEUE_NODE_LOG_SEGMENT_BYTES": str(16 << 10)},
    )
    yield proc
    finish([proc], node_name)


def _segments(node: NodeProcess) -> list[Path]:
    return sorted((node.data_dir / "log").glob("*.seg"))


def test_segments_of_acknowledged_results_are_removed(node):
    node.start()
    client = Client(node.base_url)
    due = time.time() - 600
    client.upsert(
        [{"key": f"c/{i}", "route": "r", "cadence_s": 30 * 86400, "due_at": due, "job": "j"}
         for i in range(ITEMS)]
    )
    leases: list = []
    wait_for(lambda: leases.extend(client.claim(ITEMS - len(leases))) or len(leases) == ITEMS,
             20, "every row leased")
    for lease in leases:
        client.complete(lease.lease_id, lease.key, {"key": lease.key, "pad": RESULT})
    assert len(_segments(node)) >= 3, "the results did not fill several segments"
    # Nothing is removed while results await their ack.
    before = {p.name for p in _segments(node)}
    acked: set[int] = set()

    def ack_all() -> bool:
        got = client.poll("j", max=100, wait_s=1)
        if got:
            client.ack("j", [r["id"] for r in got])
            acked.update(r["id"] for r in got)
        return len(acked) == ITEMS

    first = client.poll("j", max=10, wait_s=5)
    assert first and {p.name for p in _segments(node)} == before
    client.ack("j", [r["id"] for r in first])
    acked.update(r["id"] for r in first)
    wait_for(ack_all, 30, "every result acknowledged")
    wait_for(lambda: len(_segments(node)) == 1, 20, "compaction down to the active segment")
    # The removal's log line reaches node.log through the supervisor's pipe,
    # a moment after the files are gone.
    wait_for(lambda: "action=segments_removed" in node.log(), 10, "the removal logged")
    accounts = client.accounting()
    assert accounts["finished"] == accounts["acknowledged"] == ITEMS and accounts["balanced"]
    client.close()
    assert node.stop() == 0
    # A restart reads the one segment left and the checkpoint: same accounts.
    node.start()
    client = Client(node.base_url)
    again = client.accounting()
    for name in ("finished", "acknowledged", "awaiting_ack", "routed"):
        assert again[name] == accounts[name], name
    assert again["balanced"] and client.poll("j", max=10) == []
    client.close()
    assert node.stop() == 0


def test_log_options_are_read_and_checked(tmp_path):
    from node.config import load_config
    from node.core.errors import ConfigError

    path = tmp_path / "node.toml"
    path.write_text('log_fsync = "always"\nlog_segment_bytes = 1048576\n')
    config = load_config({}, env={}, config_file=path)
    assert (config.log_fsync, config.log_segment_bytes) == ("always", 1 << 20)
    assert load_config({}, env={"QUEUE_NODE_LOG_FSYNC": "never"}).log_fsync == "never"
    for text, words in (('log_fsync = "sometimes"', "not one of always, batch, never"),
                        ("log_segment_bytes = 100", "out of range")):
        path.write_text(text + "\n")
        with pytest.raises(ConfigError) as info:
            load_config({}, env={}, config_file=path)
        assert words in str(info.value) and f"{path}:1" in str(info.value)
