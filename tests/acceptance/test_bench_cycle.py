"""The whole-cycle bench (bench/bench_cycle.py) runs end to end in its
smallest form: a node (LocalClaimer and HTTP) and PostgreSQL, a few thousand
rows, two seconds each; every figure is positive and no completion answered
ok goes unacked. In CI PostgreSQL must run; on a machine without it the
bench must say it did not run it, and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from node.testing import ROOT

pytestmark = pytest.mark.timeout(150)


def test_bench_cycle_quick(tmp_path: Path) -> None:
    out = tmp_path / "cycle.json"
    argv = [
        sys.executable, "bench/bench_cycle.py",
        "--rows", "3000", "--seconds", "2", "--batch", "16",
        "--peers", "node_local", "node_http", "postgres",
        "--results", str(tmp_path), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    figures = {r["name"]: r for r in json.loads(out.read_text())}
    for path in ("node_local", "node_http"):
        assert figures[f"cycle.{path}.batch16.acked_per_s"]["value"] > 0, proc.stdout
        assert figures[f"cycle.{path}.batch16.lost"]["value"] == 0, proc.stdout
        assert figures[f"cycle.{path}.batch16.p50_ms"]["value"] > 0
    assert "complete" in figures["cycle.node_http.batch16.acked_per_s"]["setup"]
    pg = figures["cycle.postgres.batch16.acked_per_s"]
    if pg["value"] is None:
        assert not os.environ.get("CI"), f"PostgreSQL must run in CI: {pg}"
        assert pg["not_run"], pg  # reported, never dropped
        assert "not run: " in proc.stdout
    else:
        assert pg["value"] > 0
        assert figures["cycle.postgres.batch16.lost"]["value"] == 0
        assert pg["setup"]["synchronous_commit"] == "on"
        assert "cycle.ratio.node_local_over_postgres.batch16" in figures
    runs = [json.loads(line) for line in (tmp_path / "cycle.jsonl").read_text().splitlines()]
    local = next(r for r in runs if r["variant"] == "node_local")
    assert local["taken"] == local["completed"] == local["distinct_ok_ids"] > 0
    # Every process's CPU over the window: the node's, and the bench's own
    # claimers and receiver (the whole cycle's cost an item, clients included).
    assert local["cpu_s"]["ledger"] > 0 and local["cpu_s"]["claimers"] > 0, local["cpu_s"]
    assert local["cpu_s"]["receiver"] > 0, local["cpu_s"]
    assert "CPU a completed item" in proc.stdout
    if pg["value"] is not None:  # its backends serving the bench are counted too
        pg_run = next(r for r in runs if r["variant"] == "postgres")
        assert pg_run["cpu_s"]["postgres"] > 0 and pg_run["cpu_s"]["claimers"] > 0, pg_run


@pytest.mark.timeout(150)
def test_bench_cycle_repeat_takes_the_median_of_rounds_run_in_turn(tmp_path: Path) -> None:
    out = tmp_path / "cycle.json"
    argv = [
        sys.executable, "bench/bench_cycle.py",
        "--rows", "2000", "--seconds", "1", "--batch", "16", "--repeat", "2",
        "--peers", "node_local", "postgres",
        "--results", str(tmp_path), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    runs = [json.loads(line) for line in (tmp_path / "cycle.jsonl").read_text().splitlines()]
    # Rounds in turn: node, peer, node, peer.
    assert [(r["variant"], r["rep"]) for r in runs] == [
        ("node_local", 0), ("postgres", 0), ("node_local", 1), ("postgres", 1)
    ], runs  # fmt: skip
    figures = {r["name"]: r for r in json.loads(out.read_text())}
    local = figures["cycle.node_local.batch16.acked_per_s"]
    rates = [r["acked_per_s"] for r in runs if r["variant"] == "node_local"]
    assert local["setup"]["rounds"] == rates
    assert local["value"] == (rates[0] + rates[1]) / 2  # the median of two
    ratio = figures["cycle.ratio.node_local_over_postgres.batch16"]
    pg = [r["acked_per_s"] for r in runs if r["variant"] == "postgres"]
    each = [round(a / b, 3) for a, b in zip(rates, pg, strict=True)]
    assert ratio["setup"]["rounds"] == each, (ratio, each)
    assert abs(ratio["value"] - (rates[0] / pg[0] + rates[1] / pg[1]) / 2) < 1e-3
    assert "round 2" in proc.stdout


@pytest.mark.timeout(60)
def test_bench_cycle_reports_a_peer_it_cannot_run(tmp_path: Path) -> None:
    out = tmp_path / "cycle.json"
    argv = [
        sys.executable, "bench/bench_cycle.py", "--rows", "100", "--seconds", "1",
        "--batch", "4", "--peers", "postgres", "redis",
        "--results", str(tmp_path), "--json", str(out),
    ]  # fmt: skip
    env = {
        **os.environ,
        "QN_BENCH_PG_DSN": "postgresql://postgres@127.0.0.1:1/postgres?connect_timeout=5",
        "QN_BENCH_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    figures = {r["name"]: r for r in json.loads(out.read_text())}
    for peer in ("postgres", "redis"):
        fig = figures[f"cycle.{peer}.batch4.acked_per_s"]
        assert fig["value"] is None and fig["not_run"], fig
    assert proc.stdout.count("not run: ") == 2, proc.stdout
