"""``python -m bench`` end to end on its two smallest steps (the delivery poll
at 1,000 and 10,000 results, the completion log's group commit): the results
file holds one record a figure with its unit, setup, command and machine, and
the report and its plots are written beside it. Figures are not judged here:
the bench measures them, no test times them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from node.testing import ROOT

pytestmark = pytest.mark.timeout(90)


def test_python_m_bench_quick_writes_results_and_a_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "bench", "--quick", "--only", "poll", "completion_commit",
            "--out", str(out)]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["suite"] == "quick"
    assert [s["step"] for s in results["steps"]] == ["completion_commit", "poll"]
    figures = {f["name"]: f for f in results["figures"]}
    for name in ("delivery.poll.backlog10000.one_job_p50_ms",
                 "completion.commit.batch64.durable_per_s"):  # fmt: skip
        record = figures[name]
        assert record["value"] > 0
        assert record["unit"] in ("ms", "results/s")
        assert record["command"].startswith("python bench/")
        assert record["machine"]["cores"] >= 1 and record["machine"]["cpu_model"]
    assert figures["completion.commit.batch64.durable_per_s"]["setup"]["batch"] == 64
    # what issue 16 names and no bench measures yet is listed, not dropped
    assert figures["model.node_over_direct"]["value"] is None
    assert figures["model.node_over_direct"]["not_run"]
    text = (out / "report.md").read_text()
    assert "| delivery.poll.backlog10000.one_job_p50_ms |" in text
    assert (out / "completion.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "delivery.png").read_bytes()[:4] == b"\x89PNG"


def test_an_unknown_step_is_refused_with_the_steps_named() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "--only", "nosuchstep"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "nosuchstep" in proc.stderr and "cycle" in proc.stderr
