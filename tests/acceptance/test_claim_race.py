"""The claimer's read-to-grant window (docs/delivery.md), with real processes.

A claim reads each entry's row, checks it is still due at the version the
entry names, then grants it by compare-and-swap in the lease table. If,
between that read and that grant, another holder is granted the key, hands
in its result (the ledger writes the next due time back) and its lease ends,
the claim's grant finds nothing live to refuse it and the item **runs
again**. Here a claimer on the host (``tests/race_claimer.py``, the test
build's ``read`` stop) stops itself in that window; the node goes on, grants
the key to another consumer, which completes it; then the claimer resumes.

What the test pins down, as written in docs/delivery.md and
docs/accounting.md: the resumed claimer is granted the key (the window is
open: one extra run), its result is accepted and delivered (two results for
one occurrence), its write-back loses to the first result's by the version
guard (the row keeps the next due time the first result gave it, so the item
does not run a third time), and the books say so: the output law exact, the
input law off by one grant (routed one more than the occurrence).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from keeper.ask import ask
from node.client import Client
from node.testing import ROOT, NodeProcess, wait_for
from tests.procs import proc_state

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def node(tmp_path: Path) -> Any:
    env = {"QUEUE_NODE_STATE_INTERVAL_S": "0.2"}
    n = NodeProcess(tmp_path / "data", f"t-{uuid.uuid4().hex[:12]}", env=env).start()
    try:
        yield n
    finally:
        assert n.stop() == 0, n.log()


@pytest.mark.parametrize("path", ["c", "python"])
def test_a_completion_inside_a_claims_read_to_grant_window_runs_the_item_again(
    node: NodeProcess, stops_build: Path, path: str
) -> None:
    now = time.time()
    with Client(node.base_url) as client:
        assert client.upsert([{"key": "k", "route": "r", "due_at": now - 600, "job": "j"}]) == 1
        wait_for(lambda: (ask(node.name, {"op": "explain", "key": "k"}, 5.0) or {})
                 .get("in_ready_set"), 30, "the key published")  # fmt: skip
        version = client.row("k")["row"]["version"]

        env = dict(os.environ, QUEUE_NODE_TEST_BUILD=str(stops_build),
                   QUEUE_NODE_TEST_LEASE_STOP="read:stop", PYTHONPATH=str(ROOT))  # fmt: skip
        late = subprocess.Popen(
            [sys.executable, "-m", "tests.race_claimer", node.name, str(node.data_dir), path],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            # Stopped in the window: it read the row, due at `version`, and
            # has not granted it.
            wait_for(lambda: proc_state(late.pid) == "T" or late.poll() is not None, 30,
                     "the claimer stopped between its read and its grant")  # fmt: skip
            assert late.poll() is None, late.communicate()

            # The node goes on: the key comes back in the next publish, another
            # consumer is granted it and hands in its result.
            first = wait_for(lambda: client.claim(1, lease_s=300, consumer="first"), 30,
                             "the key granted to another consumer")  # fmt: skip
            assert [g.key for g in first] == ["k"]
            assert isinstance(client.complete(first[0].lease_id, "k", "first"), int)
            row = client.row("k")["row"]
            assert row["version"] > version and row["due_at"] > time.time(), row
        finally:
            os.kill(late.pid, signal.SIGCONT)
        out, err = late.communicate(timeout=30)
        assert late.returncode == 0, err.decode()

        # The window was open: the resumed claim granted the key, at the row
        # it read (the old due time), though the item has just run.
        second = json.loads(out)
        assert [g["key"] for g in second] == ["k"], second
        assert second[0]["due_at"] == pytest.approx(now - 600)

        # Its result is accepted and delivered: two results for one occurrence.
        assert isinstance(client.complete(second[0]["lease_id"], "k", "second"), int)
        results = client.poll("j", max=10)
        assert sorted(r["result"] for r in results) == ["first", "second"]
        # Its write-back lost to the first one's (the version guard): the row
        # keeps the next due time the first result gave it, and is not due.
        assert client.row("k")["row"]["due_at"] == row["due_at"]
        assert client.claim(5, lease_s=300) == []

        # The books: the output law exact, the input law off by the extra grant
        # (as the keeper counts after the last result).
        done_at = time.time()

        def settled() -> dict[str, Any] | None:
            acct = client.accounting()
            gaps = acct["gaps"]
            fresh = gaps["input_as_of"] > done_at and gaps["input_bound"] == 0
            return acct if acct["finished"] == 2 and fresh else None

        acct = wait_for(settled, 30, "both results counted")
        assert (acct["received"], acct["routed"], acct["waiting"]) == (1, 2, 0), acct
        assert (acct["gaps"]["output"], acct["gaps"]["finished"]) == (0, 0), acct
        assert acct["gaps"]["input"] == -1 and not acct["balanced"], acct
