"""The console (GET /), the deploy files and scripts/autoscaler.

Three tiers: the console's files served by the app (aiohttp's test server);
the deploy files parsed and checked against the contract's metric names; and
acceptance: a real node (``python -m node run``) with the console driven by a
real headless Chromium, and scripts/autoscaler run against a real node.

The browser: Debian's ``chromium`` and ``chromium-driver`` (same version, so
no driver download) driven by Selenium, a pure-Python wheel. A machine
without them skips the browser test; in CI (``CI=true``) it fails instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from node.config import Config
from node.store import open_store
from node.testing import ROOT, NodeProcess, cleanup_segments, wait_for
from workers.http.app import WorkerContext, make_app
from workers.http.console import ASSETS, CONSOLE_DIR
from workers.http.console import routes as console_routes

TOKEN = "console-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DEPLOY = ROOT / "deploy"

# CONTRACT.md "Prometheus names", plus the two histograms of issue 4.
COUNTERS = {
    "queue_node_received_total",
    "queue_node_routed_total",
    "queue_node_finished_total",
    "queue_node_acknowledged_total",
    "queue_node_expired_total",
    "queue_node_released_total",
    "queue_node_refused_total",
}
GAUGES = {
    "queue_node_due",
    "queue_node_in_flight",
    "queue_node_held",
    "queue_node_parked",
    "queue_node_oldest_lateness_ratio",
    "queue_node_keeper_vouched",
}
HISTOGRAMS = {
    "queue_node_keeper_apply_seconds",
    "queue_node_keeper_lag_seconds",
    "queue_node_keeper_publish_seconds",
    "queue_node_claim_seconds",
}
HISTOGRAM_SERIES = {f"{h}{s}" for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
# The input side of the books (issue 17): in the alert rules, not required on the dashboard.
INPUT_SIDE = {
    "queue_node_requeued_total",
    "queue_node_withdrawn_total",
    "queue_node_discarded_total",
    "queue_node_waiting",
    "queue_node_ledger_gap",
    "queue_node_ledger_input_bound",
    "queue_node_keeper_repairs_total",
}
KNOWN_SERIES = COUNTERS | GAUGES | HISTOGRAM_SERIES | INPUT_SIDE


# -- the files, served by the app ------------------------------------------------------


def _app() -> web.Application:
    ctx = WorkerContext(
        config=Config(name="t", workers=1),
        store=open_store("memory://"),
        name="t",
        started_at=time.time(),
    )
    return make_app(ctx, extra_routes=console_routes)


async def _fetch_assets() -> dict[str, tuple[int, dict[str, str], bytes]]:
    async with TestClient(TestServer(_app())) as client:
        out = {}
        for path in (
            "/",
            "/console/console.js",
            "/console/console.css",
            "/console/nope.js",
            "/console/..%2Fconsole_http.py",
            "/console/index.html",
        ):
            resp = await client.get(path)
            out[path] = (resp.status, dict(resp.headers), await resp.read())
        return out


def test_console_files_are_served_with_their_types_and_a_strict_csp() -> None:
    got = asyncio.run(_fetch_assets())
    types = {
        "/": "text/html",
        "/console/index.html": "text/html",
        "/console/console.js": "text/javascript",
        "/console/console.css": "text/css",
    }
    for path, content_type in types.items():
        status, headers, body = got[path]
        assert status == 200, (path, body[:200])
        assert headers["Content-Type"].split(";")[0] == content_type, (path, headers)
        assert "charset=utf-8" in headers["Content-Type"]
        csp = headers["Content-Security-Policy"]
        directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
        assert directives["default-src"] == "'none'"
        assert directives["script-src"] == "'self'"
        assert directives["connect-src"] == "'self'"
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert headers["X-Content-Type-Options"] == "nosniff"
    assert got["/"][2] == (CONSOLE_DIR / "index.html").read_bytes()
    for path in ("/console/nope.js", "/console/..%2Fconsole_http.py"):
        status, headers, body = got[path]
        assert status == 404, path
        assert json.loads(body)["error"]["code"] == "not_found"


class _Page(HTMLParser):
    """What index.html loads, and anything the CSP would block."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[str] = []
        self.inline_scripts = 0
        self.bad_attrs: list[str] = []
        self.ids: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"] or "")
        for name, _ in attrs:
            if name == "style" or name.startswith("on"):
                self.bad_attrs.append(f"<{tag} {name}>")
        if tag == "script":
            self._in_script = True
            if a.get("src"):
                self.loads.append(a["src"] or "")
        if tag == "link" and a.get("href"):
            self.loads.append(a["href"] or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline_scripts += 1


def test_page_has_no_inline_script_and_loads_only_the_nodes_files() -> None:
    page = _Page()
    page.feed((CONSOLE_DIR / "index.html").read_text())
    assert page.inline_scripts == 0
    assert page.bad_attrs == []
    assert len(page.ids) == len(set(page.ids)), "duplicate ids"
    served = {f"/console/{name}" for name in ASSETS}
    for url in page.loads:
        assert url == "data:," or url in served, url
    # No CDN: nothing in the console names another origin.
    for name in ASSETS:
        text = (CONSOLE_DIR / name).read_text()
        assert not re.search(r"https?://", text), name
        assert "innerHTML" not in text and "eval(" not in text, name


# -- the deploy files ------------------------------------------------------------------


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bqueue_node_[a-z_]+\b", expr))


def _exprs(doc: Any) -> Iterator[str]:
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            else:
                yield from _exprs(value)
    elif isinstance(doc, list):
        for item in doc:
            yield from _exprs(item)


def test_grafana_dashboard_names_only_the_contracts_metrics() -> None:
    doc = json.loads((DEPLOY / "grafana" / "queue-node.json").read_text())
    exprs = list(_exprs(doc))
    assert exprs
    for expr in exprs:
        names = _metric_names(expr)
        assert names, f"an expression without a queue-node metric: {expr}"
        assert names <= KNOWN_SERIES, f"unknown metric in {expr}: {names - KNOWN_SERIES}"
    used = set().union(*(_metric_names(e) for e in exprs))
    assert COUNTERS <= used and GAUGES <= used
    for histogram in HISTOGRAMS:
        assert f"{histogram}_bucket" in used, histogram
    # The first row: received, routed, finished and acknowledged side by side,
    # as totals and as rates.
    panels = doc["panels"]
    assert panels[0]["type"] == "row"
    first_row = panels[1 : next(i for i, p in enumerate(panels[1:], 1) if p["type"] == "row")]
    ledger = ["received", "routed", "finished", "acknowledged"]
    for kind in ("stat", "timeseries"):
        panel = next(p for p in first_row if p["type"] == kind)
        shown = [t["legendFormat"] for t in panel["targets"]]
        assert shown == ledger, (kind, shown)
        assert all(p["gridPos"]["y"] == panel["gridPos"]["y"] for p in first_row[:3])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))


def _yaml(path: Path) -> Any:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    return yaml.safe_load(path.read_text())


def test_alert_rules_parse_and_name_only_the_contracts_metrics() -> None:
    doc = _yaml(DEPLOY / "prometheus" / "alerts.yml")
    rules = {r["alert"]: r for g in doc["groups"] for r in g["rules"]}
    expected = {
        "QueueNodeKeeperNotVouching": "1m",
        "QueueNodeLedgerUnbalanced": "5m",
        "QueueNodeInputUnbalanced": "5m",
        "QueueNodeParkedKeysRising": "30m",
        "QueueNodeLatenessPastOneCadence": "15m",
    }
    for name, wait in expected.items():
        assert rules[name]["for"] == wait, name
    for rule in rules.values():
        names = _metric_names(rule["expr"])
        assert names and names <= KNOWN_SERIES, rule["expr"]
    unbalanced = _metric_names(rules["QueueNodeLedgerUnbalanced"]["expr"])
    assert unbalanced == {
        "queue_node_routed_total",
        "queue_node_finished_total",
        "queue_node_expired_total",
        "queue_node_released_total",
        "queue_node_in_flight",
    }
    assert "> 1" in rules["QueueNodeLatenessPastOneCadence"]["expr"]
    assert _metric_names(rules["QueueNodeInputUnbalanced"]["expr"]) == {
        "queue_node_ledger_gap",
        "queue_node_ledger_input_bound",
    }


def test_keda_scaled_object_falls_back_when_the_node_cannot_vouch() -> None:
    doc = _yaml(DEPLOY / "keda" / "scaledobject.yaml")
    assert doc["kind"] == "ScaledObject"
    spec = doc["spec"]
    assert spec["fallback"]["replicas"] >= 1
    assert spec["fallback"]["failureThreshold"] >= 1
    assert spec["minReplicaCount"] >= 1
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger.get("metricType", "AverageValue") == "AverageValue"
    meta = trigger["metadata"]
    assert meta["ignoreNullValues"] == "false"
    names = _metric_names(meta["query"])
    assert "queue_node_keeper_vouched" in names and names <= KNOWN_SERIES


# -- scripts/autoscaler, its decisions -------------------------------------------------


def _autoscaler_module() -> Any:
    path = ROOT / "scripts" / "autoscaler"
    loader = importlib.machinery.SourceFileLoader("qn_autoscaler", str(path))
    spec = importlib.util.spec_from_loader("qn_autoscaler", loader)
    module = importlib.util.module_from_spec(spec)
    # Its dataclass looks its module up while being defined.
    sys.modules["qn_autoscaler"] = module
    loader.exec_module(module)
    return module


def _state(vouched: bool, classes: Any, total: int, coming_60m: int = 0) -> dict:
    return {
        "now": {"due": {"total": total}},
        "classes": classes,
        "coming": {"60m": coming_60m},
        "trust": {"vouched": vouched, "reason": None if vouched else "keeper stalled"},
    }


def test_autoscaler_formula_and_it_keeps_the_last_decision_when_unsure() -> None:
    auto = _autoscaler_module()
    scaler = auto.Autoscaler("n", seconds_per_item=600, low=1, high=64)
    rc, line = scaler.step(_state(False, [], 0))
    assert rc == auto.RET_NOT_VOUCHED
    assert "vouched=no (keeper stalled)" in line and "no decision yet" in line
    # 30 rows due at a 1 h cadence plus 6 coming within the hour: 36 items an
    # hour at 600 s each is 6 processes (and not 7 from float rounding).
    classes = [{"cadence_s": 3600, "due": 30}, {"cadence_s": 86400, "due": 0}]
    rc, line = scaler.step(_state(True, classes, 30, coming_60m=6))
    assert rc == auto.RET_OK
    assert line.startswith("processes=6 node=n vouched=yes due=30 coming_60m=6 ")
    # Unsure again: the last decision stands, never zero.
    rc, line = scaler.step(_state(False, [], 0))
    assert rc == auto.RET_NOT_VOUCHED and "keeping processes=6" in line
    rc, line = scaler.not_running("gone")
    assert rc == auto.RET_NOT_RUNNING and "keeping processes=6" in line
    # A truncated class list: the rows not listed get the shortest cadence.
    d = auto.needed(_state(True, [{"cadence_s": 3600, "due": 10}], 20), 360, 0, 64)
    assert d.processes == 2
    # The group as the keeper writes it: {"rows": [...], "truncated": bool}.
    wrapped = _state(True, {"rows": classes, "truncated": False}, 30, coming_60m=6)
    assert auto.needed(wrapped, 600, 1, 64).processes == 6
    # Nothing to do: the floor, which is what --min says (1 by default).
    assert auto.needed(_state(True, [], 0), 1, 1, 64).processes == 1
    assert auto.needed(_state(True, [], 0), 1, 0, 64).processes == 0
    flood = _state(True, [{"cadence_s": 60, "due": 10**6}], 10**6)
    assert auto.needed(flood, 1, 1, 8).processes == 8


# -- acceptance: a real node -----------------------------------------------------------


@pytest.fixture
def start_node(tmp_path: Path, node_name: str):
    started: list[NodeProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> NodeProcess:
        node = NodeProcess(tmp_path / "data", node_name, *args, env=env)
        started.append(node)
        return node.start()

    yield start
    for node in started:
        with contextlib.suppress(ProcessLookupError, KeyError, AssertionError):
            os.kill(node.pids()["keeper"], signal.SIGCONT)
        try:
            node.stop()
        except AssertionError:
            node.kill()
    cleanup_segments(node_name)


def _seed(node: NodeProcess, due: int, coming: int, headers: dict | None = None) -> None:
    now = time.time()
    rows = [
        {
            "key": f"due-{i:03d}",
            "route": "r",
            "cadence_s": 3600,
            "sitemap": i % 5 == 0,
            "due_at": now - 180,
            "payload": {"i": i},
        }
        for i in range(due)
    ]
    rows += [
        {"key": f"soon-{i:03d}", "route": "r", "cadence_s": 3600, "due_at": now + 600}
        for i in range(coming)
    ]
    status, body = node.request("POST", "/rows", rows, headers=headers)
    assert status == 200, body


def _vouched_state(name: str, due: int) -> dict | bool:
    from shm.state import read_state

    state = read_state(name)
    total = ((state.get("now") or {}).get("due") or {}).get("total")
    return state if state["trust"]["vouched"] and total == due else False


def test_autoscaler_once_against_a_real_node(start_node, node_name: str) -> None:
    node = start_node(env={"QUEUE_NODE_STATE_INTERVAL_S": "0.5"})
    _seed(node, due=30, coming=6)
    wait_for(lambda: _vouched_state(node_name, 30), 30, "30 due rows vouched for")
    argv = [
        str(ROOT / "scripts" / "autoscaler"),
        "--name",
        node_name,
        "--once",
        "--seconds-per-item",
        "600",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"processes=6 node={node_name} vouched=yes due=30 coming_60m=6 ")

    keeper = node.pids()["keeper"]
    os.kill(keeper, signal.SIGSTOP)
    try:
        from shm.state import read_state

        wait_for(lambda: not read_state(node_name)["trust"]["vouched"], 20, "the stall seen")
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    finally:
        os.kill(keeper, signal.SIGCONT)
    assert out.returncode == 3, (out.stdout, out.stderr)
    assert out.stdout.startswith(f"node={node_name} vouched=no (")
    assert "no decision yet, changing nothing" in out.stdout


def test_every_metric_the_deploy_files_name_is_served_by_a_node(start_node) -> None:
    node = start_node(env={"QUEUE_NODE_STATE_INTERVAL_S": "0.5"})
    _seed(node, due=3, coming=0)
    wait_for(lambda: _vouched_state(node.name, 3), 30, "3 due rows vouched for")
    named = set().union(
        *(
            _metric_names(e)
            for e in _exprs(json.loads((DEPLOY / "grafana" / "queue-node.json").read_text()))
        ),
    )
    with urllib.request.urlopen(node.base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    served = set(re.findall(r"^(queue_node_[a-z_]+)", text, re.M))
    assert named <= served, f"named but not served: {sorted(named - served)}"


# -- acceptance: the console in a real browser -----------------------------------------


def _browser_paths() -> tuple[str | None, str | None]:
    chrome = next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p),
        None,
    )
    return chrome, shutil.which("chromedriver")


@pytest.fixture
def browser(tmp_path: Path):
    chrome, driver_path = _browser_paths()
    missing = []
    if chrome is None:
        missing.append("chromium")
    if driver_path is None:
        missing.append("chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip install -e '.[test]')")
    if missing:
        message = "no headless browser: install " + ", ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (.ci/run installs them)")
        pytest.skip(message)
    options = Options()
    options.binary_location = chrome
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,2400",
        "--no-first-run",
        "--disable-extensions",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=driver_path, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _severe(driver: Any, allowed: tuple[str, ...] = ()) -> list[str]:
    """The browser's console errors since the last call, less the allowed ones."""
    logs = driver.get_log("browser")
    return [
        e["message"]
        for e in logs
        if e["level"] == "SEVERE" and not any(a in e["message"] for a in allowed)
    ]


def _text(driver: Any, testid: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f'[data-testid="{testid}"]').text


def _held_row(driver: Any, key: str) -> Any:
    from selenium.webdriver.common.by import By

    rows = driver.find_elements(By.CSS_SELECTOR, f'tr[data-testid="held-row"][data-key="{key}"]')
    return rows[0] if rows else None


def _click_unhold(driver: Any, key: str) -> bool:
    """Click the key's unhold button; False when the table was redrawn under us."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        row = _held_row(driver, key)
        row.find_element(By.CSS_SELECTOR, '[data-testid="unhold"]').click()
    except (StaleElementReferenceException, AttributeError):
        return False
    return True


def _queue_state(node: NodeProcess) -> tuple[int, Any]:
    return node.request("GET", "/queue-state", headers=AUTH)


@pytest.mark.timeout(180)
def test_console_in_a_real_browser(start_node, browser, node_name: str) -> None:
    from selenium.webdriver.common.by import By

    node = start_node(
        "--token",
        TOKEN,
        env={"QUEUE_NODE_STATE_INTERVAL_S": "0.5", "QUEUE_NODE_MAX_MISSES": "1"},
    )
    _seed(node, due=30, coming=7, headers=AUTH)

    def vouched_due() -> Any:
        status, doc = _queue_state(node)
        return doc if status == 200 and doc["now"]["due"]["total"] == 30 else False

    state = wait_for(vouched_due, 30, "GET /queue-state: 30 due, vouched")

    # 1. The page loads; without the token it says it needs one and shows
    # nothing (the node refuses every read); with it, the node's due count.
    browser.get(node.base_url + "/")
    banner = browser.find_element(By.ID, "token-banner")
    wait_for(banner.is_displayed, 20, "the page to ask for the token")
    assert _text(browser, "due-total") == "–"
    assert _severe(browser, allowed=("status of 401",)) == []
    browser.find_element(By.ID, "token-input").send_keys(TOKEN)
    browser.find_element(By.ID, "token-save").click()
    assert _text(browser, "token-state") == "token set for this tab"
    wait_for(lambda: _text(browser, "due-total") == "30", 20, "the page to show 30 due")
    assert banner.is_displayed() is False
    assert _text(browser, "due-total") == str(state["now"]["due"]["total"])
    assert _text(browser, "due-sitemap") == str(state["now"]["due"]["sitemap"])
    wait_for(lambda: _text(browser, "coming-15m") == "7", 10, "7 coming within 15 min")
    assert _text(browser, "node-name") == node_name
    assert browser.find_element(By.ID, "unvouched-banner").is_displayed() is False
    wait_for(lambda: _text(browser, "ledger-balanced") == "balanced", 10, "a balanced ledger")
    # The fleet view: outside a fleet, a fleet of one, this node.
    fleet_row = f'tr[data-testid="fleet-node"][data-node="{node_name}"]'
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, fleet_row), 10, "the fleet of one")
    assert _text(browser, "fleet-summary") == f"summed over 1 node: {node_name}"
    assert _text(browser, "fleet-due") == "30"
    assert browser.find_element(By.CSS_SELECTOR, fleet_row).get_attribute("data-state") == "vouched"
    assert _severe(browser) == []

    # 2. A parked key: claimed, then released with an error; max_misses is 1.
    def claim_one() -> Any:
        # The ready set may be published a moment after the counts.
        status, body = node.request(
            "POST", "/claim", {"max": 1, "consumer": "console-test", "lease_s": 30}, headers=AUTH
        )
        assert status == 200, body
        return body["leases"][0] if body["leases"] else None

    lease = wait_for(claim_one, 10, "a lease")
    key = lease["key"]
    lease_rows = f'tr[data-testid="lease-row"][data-key="{key}"]'
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, lease_rows), 10, "the lease shown")
    error = "model exploded: <b>not html</b>"
    status, body = node.request(
        "POST",
        "/release",
        {"lease_id": lease["lease_id"], "key": key, "error": error},
        headers=AUTH,
    )
    assert status == 200, body
    row = wait_for(lambda: _held_row(browser, key), 10, f"{key} in the held table")
    assert row.get_attribute("data-parked") == "true"
    assert error in row.text  # drawn as text, not as HTML

    # The page sends the token with its button too: the key is unheld.
    wait_for(lambda: _click_unhold(browser, key), 10, "the unhold button")
    wait_for(lambda: _held_row(browser, key) is None, 10, f"{key} gone from the held table")
    status, body = node.request("GET", "/held?limit=100", headers=AUTH)
    assert key not in {h["key"] for h in body["held"]}
    assert "Unheld" in _text(browser, "action-message")

    # 3. Pause and resume the node from the page.
    browser.find_element(By.ID, "pause-node").click()
    wait_for(
        lambda: (s := _queue_state(node))[0] == 200 and s[1]["now"]["paused"]["node"],
        15,
        "the node paused",
    )
    wait_for(lambda: "whole node" in _text(browser, "paused-state"), 10, "the pause shown")
    browser.find_element(By.ID, "resume-node").click()
    wait_for(
        lambda: (s := _queue_state(node))[0] == 200 and not s[1]["now"]["paused"]["node"],
        15,
        "the node resumed",
    )
    wait_for(lambda: _text(browser, "paused-state") == "no", 10, "the resume shown")
    assert _severe(browser) == []

    # 4. The keeper stops: the page says it cannot vouch, and greys the counts.
    keeper = node.pids()["keeper"]
    os.kill(keeper, signal.SIGSTOP)
    try:
        banner = browser.find_element(By.ID, "unvouched-banner")
        wait_for(banner.is_displayed, 30, "the not-vouched banner")
        assert "unvouched" in browser.find_element(By.TAG_NAME, "body").get_attribute("class")
        status, doc = _queue_state(node)
        assert status == 503 and doc["trust"]["vouched"] is False, doc
        assert "stalled" in _text(browser, "unvouched-reason")
        vouched_check = browser.find_element(By.CSS_SELECTOR, '#checks li[data-check="vouched"]')
        assert vouched_check.get_attribute("data-level") == "fail"
        due = browser.find_element(By.ID, "due-total")
        opacity = browser.execute_script(
            "return getComputedStyle(arguments[0].closest('.counts')).opacity", due
        )
        assert float(opacity) < 1
    finally:
        os.kill(keeper, signal.SIGCONT)
    wait_for(lambda: not banner.is_displayed(), 30, "the banner gone once the keeper runs")
    # The only errors: the browser's own lines for the 503s it was answered.
    assert _severe(browser, allowed=("status of 503",)) == []
