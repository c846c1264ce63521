"""deploy/prometheus and deploy/keda for a fleet (docs/metrics.md, "A fleet"):
the rule files pass ``promtool check rules`` and their unit tests
(``promtool test rules deploy/prometheus/fleet_test.yml``), the scrape
configuration ``promtool check config``; the rules name only series a node
exports, every alert of fleet.yml is seen firing in fleet_test.yml, and the
fleet's ScaledObject queries one of fleet.yml's recording rules.

promtool comes with Debian's ``prometheus`` package (.ci/run installs it):
without it the promtool tests skip on a laptop and fail under ``CI=true``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from workers.http.metrics import (
    fleet_families,
    lease_families,
    ledger_families,
    state_families,
)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
FLEET_RULES = PROMETHEUS / "fleet.yml"
JOB = "queue-node"
# A series name in an expression, not part of a recording rule's name
# (``fleet:queue_node_due:sum``).
SERIES = re.compile(r"(?<![\w:])queue_node_[a-z_]+(?![\w:])")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool is not installed: apt-get install prometheus"
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (.ci/run installs it)")
        pytest.skip(message)
    return path


def _run(*args: str) -> str:
    done = subprocess.run(
        [_promtool(), *args], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


def _yaml(path: Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text())


def _rules(path: Path) -> list[dict[str, Any]]:
    return [rule for group in _yaml(path)["groups"] for rule in group["rules"]]


def test_promtool_checks_the_rules_and_the_scrape_config() -> None:
    out = _run("check", "rules", "deploy/prometheus/alerts.yml", "deploy/prometheus/fleet.yml")
    assert out.count("SUCCESS") == 2, out
    out = _run("check", "config", "deploy/prometheus/prometheus.yml")
    assert "2 rule files found" in out, out


def test_the_fleet_rules_pass_their_unit_tests() -> None:
    out = _run("test", "rules", "deploy/prometheus/fleet_test.yml")
    assert "SUCCESS" in out, out


def _exported() -> set[str]:
    """Every series name a fleet node's scrape can carry (what ``render``
    reads at scrape time), from a state in which the keeper vouches."""
    now = time.time()
    pid = os.getpid()
    member = {"name": "a", "state": "member", "live": ["a"], "last_heartbeat_age_s": 0.1,
              "membership_timeout_s": 10.0}  # fmt: skip
    state = {
        "status": "live", "exact": True, "writer_pid": pid, "heartbeat_at": now,
        "counts_at": now, "counts_writer": {"pid": pid, "exact": True},
        "doc": {
            "now": {"due": {"sitemap": 1, "discovered": 2}},
            "classes": [{"route": "r", "oldest_lateness_ratio": 0.5}],
            "trust": {"membership": member, "store": {}, "verify": {}},
        },
    }  # fmt: skip
    accounting = {"waiting": 0, "gaps": {"input": 0, "input_bound": 0}}
    families = [
        *ledger_families(accounting),
        *lease_families({"leased": 0}),
        *state_families(state, ["r"], now),
        *fleet_families(state, now),
    ]
    return {sample.name for family in families for sample in family.samples}


def test_the_fleet_rules_name_only_series_a_node_exports() -> None:
    exported = _exported()
    assert {"queue_node_fleet_member", "queue_node_fleet_live_nodes"} <= exported
    assert "queue_node_due" in exported  # the state above vouches
    rules = _rules(FLEET_RULES)
    used: set[str] = set()
    for rule in rules:
        names = set(SERIES.findall(rule["expr"]))
        assert names <= exported, (rule.get("record") or rule.get("alert"), names - exported)
        used |= names
        # Nodes are counted as the scrape job's targets (prometheus.yml).
        for job in re.findall(r'job="([^"]*)"', rule["expr"]):
            assert job == JOB, rule["expr"]
    assert {"queue_node_due", "queue_node_fleet_member", "queue_node_fleet_live_nodes"} <= used
    (scrape,) = _yaml(PROMETHEUS / "prometheus.yml")["scrape_configs"]
    assert scrape["job_name"] == JOB


def test_every_fleet_alert_is_seen_firing_in_its_unit_tests() -> None:
    alerts = {rule["alert"] for rule in _rules(FLEET_RULES) if "alert" in rule}
    tests = _yaml(PROMETHEUS / "fleet_test.yml")["tests"]
    firing = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    assert alerts and firing == alerts, alerts - firing


def test_the_fleet_scaled_object_queries_a_recording_rule_and_falls_back() -> None:
    doc = _yaml(ROOT / "deploy" / "keda" / "scaledobject-fleet.yaml")
    assert doc["kind"] == "ScaledObject"
    spec = doc["spec"]
    assert spec["minReplicaCount"] >= 1
    assert spec["fallback"]["replicas"] >= 1 and spec["fallback"]["failureThreshold"] >= 1
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger.get("metricType", "AverageValue") == "AverageValue"  # the fallback needs it
    meta = trigger["metadata"]
    # An empty answer (a node down or not vouching) is a failed poll, not 0.
    assert meta["ignoreNullValues"] == "false"
    records = {rule["record"]: rule["expr"] for rule in _rules(FLEET_RULES) if "record" in rule}
    assert meta["query"].strip() == "fleet:queue_node_due:sum"
    # ... a rule that sums the nodes only while every node vouches.
    expr = records[meta["query"].strip()]
    assert "sum(queue_node_due)" in expr and "fleet:queue_node_vouching_nodes:count" in expr
    assert "queue_node_keeper_vouched == 1" in records["fleet:queue_node_vouching_nodes:count"]
