"""Processes that outlive a restart of their node never grant from the old
tables: long-lived LocalClaimers (how GPU workers on the host claim) across a
clean restart (SIGTERM) and across kill -9 of the whole node, claiming
throughout.

What must hold: no key is ever in two live leases (every row here is
one-shot, 30-day cadence, and every lease is completed, so each key is
granted exactly once); every completion of a lease granted before a restart
is accepted by the node after it; the claimers go on claiming from the new
node. Before the seal, a claimer kept granting in the unlinked table of the
stopped node and the new node granted the same keys again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from node.testing import ROOT, NodeProcess, finish, wait_for

ROWS = 60_000
CLAIMERS = 2
# Grants each claimer must make in each phase before the next fault.
PER_PHASE = 150


def _events(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def _claim_over_http(node: NodeProcess, out: Path, rounds: int = 20) -> None:
    """The new node's own consumers: what they are granted must not be what
    a claimer of the old node still holds."""
    from node.client import Client

    with Client(node.base_url) as client, open(out, "a", encoding="utf-8") as f:
        for _ in range(rounds):
            for grant in client.claim(50, lease_s=300, consumer="http"):
                f.write(json.dumps({"ev": "grant", "key": grant.key, "lease_id": grant.lease_id,
                                    "boot": "http", "t": 0}) + "\n")  # fmt: skip
                client.complete(grant.lease_id, grant.key, {"by": "http"})
                f.write(json.dumps({"ev": "done", "key": grant.key, "lease_id": grant.lease_id,
                                    "outcome": "ok", "t": 0}) + "\n")  # fmt: skip


def _grants_after(paths: list[Path], t: float) -> list[int]:
    return [sum(1 for e in _events(p) if e["ev"] == "grant" and e["t"] > t) for p in paths]


@pytest.mark.timeout(300)
def test_long_lived_local_claimers_across_a_clean_restart_and_a_kill(
    tmp_path: Path, node_name: str
) -> None:
    data = tmp_path / "data"
    node = NodeProcess(data, node_name).start()
    nodes = [node]
    procs: list[subprocess.Popen] = []
    stop_file = tmp_path / "stop"
    outs = [tmp_path / f"claimer{i}.jsonl" for i in range(CLAIMERS)]
    http_out = tmp_path / "http.jsonl"
    try:
        for start in range(0, ROWS, 10_000):
            rows = [{"key": f"k{i}", "route": "r", "cadence_s": 30 * 86400, "due_at": 0}
                    for i in range(start, start + 10_000)]  # fmt: skip
            status, body = node.request("POST", "/rows", rows, timeout_s=60)
            assert status == 200, body
        for out in outs:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.restart_claimer", node_name, str(data), str(out),
                 str(stop_file)], cwd=ROOT,
            ))  # fmt: skip

        def phase_done(since: float) -> bool:
            for proc in procs:
                assert proc.poll() is None, f"a claimer exited {proc.returncode}"
            return all(n >= PER_PHASE for n in _grants_after(outs, since))

        wait_for(lambda: phase_done(0.0), 60, "grants before the restart")
        # 1. a clean restart while they claim
        assert node.stop() == 0
        node = NodeProcess(data, node_name).start()
        nodes.append(node)
        restarted_at = node.node_json()["started_at"]
        _claim_over_http(node, http_out)
        wait_for(lambda: phase_done(restarted_at), 90, "grants from the restarted node")
        # 2. kill -9 of the whole node while they claim
        node.kill()
        node = NodeProcess(data, node_name).start()
        nodes.append(node)
        killed_at = node.node_json()["started_at"]
        _claim_over_http(node, http_out)
        wait_for(lambda: phase_done(killed_at), 90, "grants after the kill")
        stop_file.touch()
        for proc in procs:
            assert proc.wait(timeout=150) == 0
        assert node.stop() == 0
    finally:
        stop_file.touch()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        finish(nodes, node_name)

    events = [e for out in [*outs, http_out] for e in _events(out)]
    grants = [e for e in events if e["ev"] == "grant"]
    done = {(e["key"], e["lease_id"]): e["outcome"] for e in events if e["ev"] == "done"}
    twice = {key: n for key, n in Counter(g["key"] for g in grants).items() if n > 1}
    assert not twice, f"keys leased twice: {dict(list(twice.items())[:5])}"
    outcomes = Counter(done.get((g["key"], g["lease_id"]), "never") for g in grants)
    assert set(outcomes) == {"ok"}, outcomes
    # each claimer went on with the second node's segments (it reattached)
    boots = defaultdict(set)
    for out in outs:
        for e in _events(out):
            if e["ev"] == "grant":
                boots[out.name].add(e["boot"])
    assert all(len(b) >= 2 for b in boots.values()), boots
    refused = Counter(e["code"] for e in events if e["ev"] == "refused")
    assert set(refused) <= {"node_restarted", "not_ready"}, refused


@pytest.mark.timeout(120)
def test_a_local_claimer_follows_a_restart_that_made_a_segment_anew(
    tmp_path: Path, node_name: str
) -> None:
    """After a kill -9 the restart reattaches the lease table (not sealed),
    but makes the ready set anew when its size changed: a claimer must not
    go on waiting on the unlinked one for ever. (Its entries are still
    claimed: each is checked against its row and leased in the one lease
    table; once they are gone the claimer finds the names lead elsewhere and
    reattaches.)"""
    from node.client import Client, LocalClaimer

    data = tmp_path / "data"
    node = NodeProcess(data, node_name, "--ready-size", "100").start()
    nodes = [node]
    try:
        rows = [{"key": f"k{i}", "route": "r", "cadence_s": 30 * 86400, "due_at": 0}
                for i in range(300)]  # fmt: skip
        assert node.request("POST", "/rows", rows)[0] == 200
        claimer = LocalClaimer(node_name, data_dir=data)
        try:
            first = claimer.claim(1, lease_s=300, wait_s=10)
            assert len(first) == 1
            boot = claimer.boot_id
            node.kill()
            node = NodeProcess(data, node_name, "--ready-size", "200").start()
            nodes.append(node)
            keys = [first[0].key]

            def reattached() -> bool:
                keys.extend(g.key for g in claimer.claim(50, lease_s=300, wait_s=0.2))
                return claimer.boot_id != boot

            wait_for(reattached, 30, "the claimer to reattach")
            more = wait_for(lambda: claimer.claim(5, lease_s=300, wait_s=0.5), 30, "grants")
            keys += [g.key for g in more]
            assert len(keys) == len(set(keys)), "a key was leased twice"
            claimer.complete(first[0].lease_id, first[0].key, "done")
        finally:
            claimer.close()
        with Client(node.base_url) as client:
            assert first[0].key not in {lease["key"] for lease in client.leases()}
        assert node.stop() == 0
    finally:
        finish(nodes, node_name)
