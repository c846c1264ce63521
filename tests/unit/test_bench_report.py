"""The report of ``python -m bench`` (bench/report.py) from a small synthetic
results file: the markdown names every figure (a peer that did not run
included, with why), marks the targets met and missed, and the PNG plots are
written; and the suite's derived figure, the keeper's bytes a row
(bench/suite.py), is the USS above the empty node's over the rows."""

from __future__ import annotations

from pathlib import Path

from bench import report
from bench.suite import fig, keeper_memory, lag_figures

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _results() -> dict:
    setup = {"rows": 20_000, "procs": 2, "seconds": 5}
    figures = [
        fig("cycle.node_local.batch64.acked_per_s", 12_000.0, "items/s", {**setup, "batch": 64}),
        fig("cycle.postgres.batch64.acked_per_s", 4_000.0, "items/s", {**setup, "batch": 64}),
        fig("cycle.redis.batch64.acked_per_s", None, "items/s", {**setup, "batch": 64},
            not_run="ConnectionError: no server at 127.0.0.1:6379"),
        fig("cycle.ratio.node_local_over_postgres.batch64", 3.0, "x", {**setup, "batch": 64},
            target=5.0, better="higher"),
        fig("keeper.publish.best5000_written_excl3000_p50_ms", 0.4, "ms", {"rows": 20_000},
            target=0.5, better="lower"),
        fig("keeper.lag.node_p99_ms", 12.5, "ms", {"rows": 20_000}, target=5.0, better="lower"),
        fig("micro.apply.median_us", 2.1, "us", {"ops": 1000}),
        fig("micro.best_k.median_us", 480.0, "us", {"ops": 1}),
    ]  # fmt: skip
    for f in figures:
        f["command"] = "python bench/bench_cycle.py --rows 20000 --seconds 5 --json x.json"
    machine = {"cpu_model": "a test CPU", "cores": 2, "memory_bytes": 8 * 2**30,
               "python": "3.11", "git_commit": "0123456789abcdef",
               "date": "2026-01-01"}  # fmt: skip
    steps = [{"step": "cycle", "seconds": 60.0, "rc": 0, "command": "python ..."}]
    return {"suite": "quick", "machine": machine, "seconds": 61.0, "steps": steps,
            "figures": figures}  # fmt: skip


def test_the_report_writes_its_tables_and_plots(tmp_path: Path) -> None:
    path = report.write_report(_results(), tmp_path)
    text = path.read_text()
    assert path == tmp_path / "report.md"
    assert "a test CPU, 2 cores, 8 GiB memory" in text
    for name in ("cycle.node_local.batch64.acked_per_s", "keeper.lag.node_p99_ms",
                 "micro.apply.median_us"):  # fmt: skip
        assert f"| {name} |" in text
    assert "not run: ConnectionError: no server at 127.0.0.1:6379" in text
    assert "| keeper.lag.node_p99_ms | 12.50 | ms | ≤ 5.00 MISS |" in text
    assert "| keeper.publish.best5000_written_excl3000_p50_ms | 0.4 | ms | ≤ 0.5 ok |" in text
    assert "| node_local_over_postgres.batch64 | 3.00 | ≥ 5.00 MISS |" in text
    # the peers by batch: the node, PostgreSQL, and Redis reported as not run
    assert "| 64 | 12,000 | 4,000 | not run: ConnectionError" in text
    for png in ("peers_cycle.png", "targets.png", "cycle.png", "keeper.png", "micro.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC, png
        assert f"]({png})" in text


def test_a_target_is_met_on_its_side() -> None:
    lower = fig("a", 4.0, "ms", target=5.0, better="lower")
    higher = fig("b", 4.0, "x", target=5.0, better="higher")
    assert report.met(lower) is True and report.met(higher) is False
    assert report.share_of_target(lower) == 1.25
    assert report.met(fig("c", None, "ms", target=5.0, better="lower")) is None


def test_the_keepers_bytes_a_row_are_its_uss_above_an_empty_keeper() -> None:
    figures = [
        fig("keeper.startup.rows0.keeper_uss_bytes", 18_000_000, "bytes", {"rows": 0}),
        fig("keeper.startup.rows1000000.keeper_uss_bytes", 170_000_000, "bytes",
            {"rows": 1_000_000}),
        fig("keeper.startup.rows250000.keeper_uss_bytes", None, "bytes", {"rows": 250_000}),
    ]  # fmt: skip
    got = {f["name"]: f for f in keeper_memory(figures)}
    assert got["keeper.memory.rows1000000.bytes_per_row"]["value"] == 152.0
    assert got["keeper.memory.rows1000000.bytes_per_row"]["target"] == 150.0
    assert got["keeper.memory.rows250000.bytes_per_row"]["value"] is None


def test_the_lag_target_is_the_lag_from_the_commit() -> None:
    doc = {"rows": 250_000, "target_rate": 15_000, "achieved_rate": 15_000,
           "lag": {"node": {"p50_ms": 2.5, "p99_ms": 9.3}, "apply_us": 14.7},
           "from_commit": {"samples": 1266, "p50_ms": 0.42, "p99_ms": 3.79}}  # fmt: skip
    got = {f["name"]: f for f in lag_figures([doc], {"machine": "x"})}
    assert got["keeper.lag.from_commit_p99_ms"]["value"] == 3.79
    assert got["keeper.lag.from_commit_p99_ms"]["target"] == 5.0
    assert report.met(got["keeper.lag.from_commit_p99_ms"]) is True
    assert got["keeper.lag.node_p99_ms"].get("target") is None

