"""Acceptance: ``python -m node demo`` runs the whole node end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from node.core.errors import ConfigError
from node.demo import MARKER, demo_rows, prepare_data_dir
from node.testing import ROOT

pytestmark = pytest.mark.timeout(90)


def _demo(*args: str, timeout_s: float = 75) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node", "demo", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_demo_500_rows_balances_and_acks_every_item_once(tmp_path: Path) -> None:
    data_dir = tmp_path / "demo"
    done = _demo("--rows", "500", "--data-dir", str(data_dir))
    out = done.stdout
    assert done.returncode == 0, f"stdout:\n{out}\nstderr:\n{done.stderr[-3000:]}"
    assert "balanced: yes" in out
    assert "acknowledged exactly once: yes (500 of 500 items)" in out
    ledger = {
        parts[0]: int(parts[1])
        for line in out.splitlines()
        if len(parts := line.split()) == 2 and parts[1].isdigit()
    }
    assert ledger["routed"] == ledger["finished"] == ledger["acknowledged"] == 500, out
    assert ledger["in_flight"] == ledger["awaiting_ack"] == 0, out
    assert (data_dir / MARKER).exists() and (data_dir / "node.log").exists()
    assert not (data_dir / "node.json").exists()  # the node stopped cleanly


def test_demo_refuses_a_directory_it_did_not_make(tmp_path: Path) -> None:
    other = tmp_path / "precious"
    other.mkdir()
    (other / "schedule.db").write_text("not the demo's")
    done = _demo("--rows", "10", "--data-dir", str(other), timeout_s=20)
    assert done.returncode == 2
    assert "is not empty" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert (other / "schedule.db").read_text() == "not the demo's"


def test_a_previous_demo_directory_is_emptied_and_reused(tmp_path: Path) -> None:
    path = prepare_data_dir(tmp_path / "d")
    (path / "node.log").write_text("old run")
    again = prepare_data_dir(tmp_path / "d")
    assert again == path and sorted(p.name for p in path.iterdir()) == [MARKER]
    with pytest.raises(ConfigError, match="not a directory"):
        prepare_data_dir(path / MARKER)


def test_seeded_rows_cover_routes_cadences_and_sitemap_flags() -> None:
    rows = demo_rows(60, now=1_000_000.0)
    assert {r.route for r in rows} == {"pages", "listings", "documents"}
    assert {r.sitemap for r in rows} == {True, False}
    assert {r.cadence_s for r in rows} == {None, 30 * 86400}
    assert all(r.due_at < 1_000_000.0 - 59 for r in rows)  # due, in a past minute
    assert len({r.key for r in rows}) == 60
