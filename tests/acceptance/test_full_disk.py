"""A full disk under a running node: ``/complete`` answers 503
``log_unavailable``, nothing already accepted is lost, and completions are
accepted again once there is space (each retry finished exactly once).

Two ways to fill the disk:

- a real one: a 2 MiB tmpfs mounted on the node's ``<data-dir>/log`` and
  filled with a file (needs the right to mount; skipped, with the reason,
  where mounting is impossible);
- the completion log's fault seam, driven from outside the ledger process:
  in test-hook mode the ledger reads ``QUEUE_NODE_TEST_LOG_FAULTS``, a
  control file whose word (``enospc``) makes its writes fail
  (``node/completion/faults.py``).

Waits poll to deadlines; nothing sleeps to synchronise.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

from node.client import Client, ClientError
from node.testing import NodeProcess, finish, wait_for

pytestmark = pytest.mark.timeout(120)

CADENCE_30D = 30 * 86400
BIG = "x" * 16_000  # a result that needs fresh pages on any filesystem


@pytest.fixture
def nodes(tmp_path, node_name):
    started: list[NodeProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> NodeProcess:
        node = NodeProcess(tmp_path / "data", node_name, *args, env=env)
        started.append(node)
        return node.start()

    yield start
    finish(started, node_name)


def _seed_and_claim(client: Client, n: int) -> list:
    due = time.time() - 3600
    rows = [
        {"key": f"k/{i:03d}", "route": "r", "cadence_s": CADENCE_30D, "due_at": due, "job": "j"}
        for i in range(n)
    ]
    assert client.upsert(rows) == n
    got: dict[str, object] = {}

    def more() -> bool:
        try:
            grants = client.claim(n - len(got), lease_s=600, consumer="t")
        except ClientError as exc:
            if exc.status == 503:  # not_ready: before the keeper's first publish
                return False
            raise
        got.update((g.key, g) for g in grants)
        return len(got) == n

    wait_for(more, 20, f"{n} leases")
    return sorted(got.values(), key=lambda g: g.key)


def _refused_log_unavailable(client: Client, grant) -> None:
    with pytest.raises(ClientError) as err:
        client.complete(grant.lease_id, grant.key, BIG)
    assert (err.value.status, err.value.code) == (503, "log_unavailable"), err.value


def _drain_exactly_once(client: Client, want: dict[str, int]) -> None:
    """Poll and ack until every key of ``want`` (key -> result id) came back
    with that id, once."""
    seen: dict[str, int] = {}

    def more() -> bool:
        results = client.poll("j", max=1000)
        for r in results:
            assert r["key"] not in seen, f"{r['key']} offered twice"
            assert r["result"] == BIG
            seen[r["key"]] = r["id"]
        if results:
            assert client.ack("j", [r["id"] for r in results]) == len(results)
        return len(seen) == len(want)

    wait_for(more, 20, f"{len(want)} results")
    assert seen == want


def _balanced(client: Client, **want: int) -> dict:
    box: list[dict] = []

    def check() -> bool:
        box[:] = [client.accounting()]
        return box[0]["balanced"] and all(box[0][k] == v for k, v in want.items())

    try:
        wait_for(check, 20, f"/accounting balanced with {want}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: last answer {box}") from None
    return box[0]


def _full_then_space_again(node: NodeProcess, fill, free) -> None:
    """The scenario both tests run: 3 accepted, disk full (every completion
    refused, nothing lost), space back (the refused ones accepted, once)."""
    client = Client(node.base_url)
    grants = _seed_and_claim(client, 8)
    ids = {g.key: client.complete(g.lease_id, g.key, BIG) for g in grants[:3]}

    fill()
    for g in grants[3:]:
        _refused_log_unavailable(client, g)
    # Everything accepted before is still there, offered while the disk is full.
    offered = client.poll("j", max=100)
    assert {r["key"]: r["id"] for r in offered} == ids
    acct = _balanced(client, finished=3, in_flight=5)  # the refused leases are still live
    assert acct["awaiting_ack"] == 3

    free()
    for g in grants[3:]:
        ids[g.key] = client.complete(g.lease_id, g.key, BIG)  # the retry is accepted
        client.complete(g.lease_id, g.key, BIG)  # a repeat: 200, nothing written again
    assert len(set(ids.values())) == 8
    _balanced(client, finished=8, in_flight=0)

    # After a restart every accepted result is still offered, each once.
    client.close()
    assert node.stop() == 0
    node.start()
    client = Client(node.base_url)
    _drain_exactly_once(client, ids)
    _balanced(client, finished=8, acknowledged=8, awaiting_ack=0, in_flight=0)
    client.close()
    assert node.stop() == 0


def test_a_full_disk_through_the_fault_seam(nodes, tmp_path):
    control = tmp_path / "log-faults"
    node = nodes(env={"QUEUE_NODE_TEST_LOG_FAULTS": str(control)})
    _full_then_space_again(
        node, lambda: control.write_text("enospc\n"), lambda: control.write_text("")
    )
    log = node.log_path.read_text(errors="replace")
    assert "action=log_unavailable" in log and "No space left on device" in log


# -- a real small filesystem -----------------------------------------------------------------


@pytest.fixture
def small_log_fs(tmp_path):
    """A 2 MiB tmpfs on ``<data-dir>/log``; skips where mounting is impossible."""
    mount_point = tmp_path / "data" / "log"
    mount_point.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN); this user is not")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount_point)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    yield mount_point
    # Lazy: a ledger killed by the test may still be closing its files.
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)


def _fill(directory: Path) -> Path:
    """Write a file until the filesystem says ENOSPC."""
    filler = directory / "filler"
    chunk = b"\0" * 4096
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def test_a_full_disk_on_a_real_small_filesystem(nodes, small_log_fs):
    # Without the log's zeros ahead (below), a completion needs new space.
    node = nodes(env={"QUEUE_NODE_LOG_PREALLOCATE_BYTES": "0"})
    fillers: list[Path] = []
    _full_then_space_again(
        node, lambda: fillers.append(_fill(small_log_fs)), lambda: fillers.pop().unlink()
    )
    assert "No space left on device" in node.log_path.read_text(errors="replace")


def test_the_logs_zeros_ahead_take_completions_on_a_full_disk_then_refuse(nodes, small_log_fs):
    """The default: the active segment is filled with zeros ahead of its
    writes (``log_preallocate_bytes``), as far as the disk allows. Once the
    disk is full, completions still go into those zeros; past them, 503."""
    node = nodes(env={"QUEUE_NODE_LOG_PREALLOCATE_BYTES": str(1 << 20)})
    client = Client(node.base_url)
    grants = _seed_and_claim(client, 150)  # 150 results of 16 KB: more than 2 MiB
    ids = {g.key: client.complete(g.lease_id, g.key, BIG) for g in grants[:3]}
    [segment] = small_log_fs.glob("*.seg")
    reserved = segment.stat().st_size
    assert reserved > 1 << 20  # the zeros ahead, taken before the disk filled
    filler = _fill(small_log_fs)
    refused = 0
    for g in grants[3:]:
        try:
            ids[g.key] = client.complete(g.lease_id, g.key, BIG)
        except ClientError as exc:
            assert (exc.status, exc.code) == (503, "log_unavailable"), exc
            refused += 1
    accepted = len(ids) - 3
    assert accepted >= 40, "the zeros reserved before the disk filled took no completion"
    assert refused > 0, "the disk never refused a completion"
    _balanced(client, finished=len(ids), in_flight=refused)
    filler.unlink()
    client.close()
    assert node.stop() == 0
    node.start()
    client = Client(node.base_url)
    _drain_exactly_once(client, ids)  # every accepted one, once, after a restart
    _balanced(client, finished=len(ids), acknowledged=len(ids), awaiting_ack=0)
    client.close()
    assert node.stop() == 0
