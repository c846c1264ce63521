"""``GET /metrics``: Prometheus text for every process of the node.

Unit tier: ``node.core.metrics`` outside a node and across real processes in
multiprocess mode, and the route labels from a state document. Acceptance
tier: a real node (``node/testing.py``), its counters against
``/accounting``, a worker killed -9 and restarted, the keeper stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.core import metrics
from node.testing import ROOT, NodeProcess, finish, wait_for
from workers.http.metrics import OTHER_ROUTE, fleet_families, oldest_ratios

pytestmark = pytest.mark.timeout(120)

CONTRACT_NAMES = (
    "queue_node_received_total",
    "queue_node_routed_total",
    "queue_node_finished_total",
    "queue_node_acknowledged_total",
    "queue_node_expired_total",
    "queue_node_released_total",
    "queue_node_refused_total",
    "queue_node_due",
    "queue_node_in_flight",
    "queue_node_held",
    "queue_node_parked",
    "queue_node_oldest_lateness_ratio",
    "queue_node_keeper_vouched",
    "queue_node_keeper_apply_seconds",
    "queue_node_keeper_lag_seconds",
    "queue_node_requeued_total",
    "queue_node_withdrawn_total",
    "queue_node_discarded_total",
    "queue_node_waiting",
    "queue_node_keeper_repairs_total",
)
LEDGER_COUNTERS = (
    "received", "routed", "finished", "acknowledged", "expired", "released", "refused",
    "requeued", "withdrawn", "discarded",
)
# The keeper writes its counts this often in these tests (default 5 s).
FAST_STATE = {"QUEUE_NODE_STATE_INTERVAL_S": "0.2"}


class Scrape:
    """One parsed /metrics answer."""

    def __init__(self, text: str, content_type: str = "") -> None:
        self.text = text
        self.content_type = content_type
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: dict[tuple[str, tuple], float] = {}
        for family in self.families.values():
            for s in family.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, tuple(sorted(labels.items()))))

    def has(self, name: str) -> bool:
        """A family of that name, or a sample of that name (``_total``)."""
        return name in self.families or any(n == name for n, _ in self.samples)

    def labels(self, name: str, label: str) -> set[str]:
        return {dict(lb)[label] for n, lb in self.samples if n == name}


def scrape(node: NodeProcess) -> Scrape:
    with urllib.request.urlopen(node.base_url + "/metrics", timeout=10) as resp:
        assert resp.status == 200
        return Scrape(resp.read().decode(), resp.headers.get("Content-Type", ""))


@pytest.fixture
def node(tmp_path, node_name):
    proc = NodeProcess(tmp_path / "data", node_name, env=FAST_STATE)
    yield proc
    finish([proc], node_name)


def _claim(node: NodeProcess, n: int) -> list[dict[str, Any]]:
    status, body = node.request("POST", "/claim", {"max": n, "consumer": "t"})
    assert status == 200, body
    return body["leases"]


def _claim_exactly(node: NodeProcess, n: int) -> list[dict[str, Any]]:
    """Claims until n leases are granted (a row shows up in the ready set
    only at the keeper's next publish)."""
    got: list[dict[str, Any]] = []

    def more() -> bool:
        got.extend(_claim(node, n - len(got)))
        return len(got) == n

    wait_for(more, 20, f"{n} leases")
    return got


def _vouched(node: NodeProcess) -> Scrape | None:
    s = scrape(node)
    return s if s.value("queue_node_keeper_vouched") == 1 else None


# -- unit: node.metrics ----------------------------------------------------------------


def test_outside_a_node_metrics_record_in_process():
    assert metrics.multiprocess_dir() is None
    before = Scrape(metrics.exposition().decode())
    base = before.value("queue_node_claim_grants_total") or 0
    metrics.observe_claim(0.001, 3)
    metrics.observe_apply(2e-6)
    metrics.observe_lag("external", 0.2)
    metrics.observe_lag("nonsense", 0.2)  # not recorded, and no error
    metrics.count_request("BREW", 418)
    after = Scrape(metrics.exposition().decode())
    assert after.value("queue_node_claim_grants_total") == base + 3
    assert after.value("queue_node_keeper_lag_seconds_count", origin="outside") >= 1
    assert after.labels("queue_node_keeper_lag_seconds_count", "origin") == {"node", "outside"}
    assert after.value("queue_node_http_requests_total", method="other", status="418") >= 1


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env},
        capture_output=True, text=True, timeout=60,
    )


def test_multiprocess_files_add_up_across_processes(tmp_path):
    mp_dir = metrics.prepare_dir(tmp_path)
    assert (os.stat(mp_dir).st_mode & 0o777) == 0o700
    env = {metrics.ENV_DIR: str(mp_dir)}
    record = (
        "from node.core import metrics; "
        "metrics.observe_claim(0.002, 2); metrics.observe_apply(1e-6)"
    )
    for _ in range(3):
        out = _python(record, env)
        assert out.returncode == 0, out.stderr
    out = _python("import sys; from node.core import metrics; sys.stdout.write("
                  "metrics.exposition().decode())", env)
    assert out.returncode == 0, out.stderr
    summed = Scrape(out.stdout)
    assert summed.value("queue_node_claim_grants_total") == 6
    assert summed.value("queue_node_claim_seconds_count") == 3
    assert summed.value("queue_node_keeper_apply_seconds_count") == 3
    # A new node start empties the directory.
    metrics.prepare_dir(tmp_path)
    assert list(mp_dir.glob("*.db")) == []


def test_unusable_multiprocess_dir_does_not_break_a_process(tmp_path):
    env = {metrics.ENV_DIR: str(tmp_path / "missing")}
    out = _python("from node.core import metrics; metrics.observe_apply(1e-6); "
                  "metrics.observe_claim(0.1, 1); print(len(metrics.exposition()))", env)
    assert out.returncode == 0, out.stderr
    assert "metrics_disabled" in out.stderr


# -- unit: route labels -------------------------------------------------------------------


def _doc(classes: list[dict], oldest: list[dict] | None, classes_cut=False, oldest_cut=False):
    doc: dict[str, Any] = {"classes": classes, "classes_truncated": classes_cut}
    if oldest is not None:
        doc["lateness"] = {"oldest": oldest, "oldest_truncated": oldest_cut}
    return doc


def test_oldest_ratio_is_the_max_per_configured_route_and_other():
    classes = [
        {"route": "pages", "oldest_lateness_ratio": 0.5},
        {"route": "pages", "oldest_lateness_ratio": 1.5},
        {"route": "misc", "oldest_lateness_ratio": 2.0},
        {"route": "junk", "oldest_lateness_ratio": 0.1},
        {"route": "pages", "oldest_lateness_ratio": None},  # nothing due in that class
    ]
    got = oldest_ratios(_doc(classes, None), {"pages", "feeds"})
    assert got == {"pages": 1.5, "feeds": 0.0, OTHER_ROUTE: 2.0}


def test_oldest_ratio_leaves_out_what_cut_lists_cannot_tell():
    classes = [{"route": "feeds", "oldest_lateness_ratio": 0.2}]
    oldest = [{"route": "pages", "lateness_ratio": 3.0}]
    # Both lists cut: only "oldest" (sorted by lateness) is trusted; feeds
    # and other are unknown, so absent rather than 0.
    got = oldest_ratios(_doc(classes, oldest, True, True), {"pages", "feeds"})
    assert got == {"pages": 3.0}
    # "oldest" whole: every class with due rows is in it (feeds has none).
    classes = [{"route": "feeds", "oldest_lateness_ratio": None}]
    got = oldest_ratios(_doc(classes, oldest, True, False), {"pages", "feeds"})
    assert got == {"pages": 3.0, "feeds": 0.0, OTHER_ROUTE: 0.0}


def _fleet_state(counts_at: float, **membership: Any) -> dict[str, Any]:
    member = {
        "name": "a", "state": "member", "live": ["a", "b", "c"],
        "last_heartbeat_age_s": 0.5, "membership_timeout_s": 10.0, **membership,
    }  # fmt: skip
    return {"counts_at": counts_at, "doc": {"trust": {"membership": member, "store": {}}}}


def _fleet_gauges(state: dict[str, Any] | None, now: float) -> dict[str, float]:
    return {f.name: f.samples[0].value for f in fleet_families(state, now)}


def test_fleet_gauges_say_whether_this_node_is_in_a_current_node_list():
    now = 1_000_000.0
    member, live = "queue_node_fleet_member", "queue_node_fleet_live_nodes"
    assert _fleet_gauges(_fleet_state(now - 2), now) == {member: 1, live: 3}
    # Out of the list it read (lapsed, forgotten): seen, and not a member.
    assert _fleet_gauges(_fleet_state(now, live=["b", "c"]), now) == {member: 0, live: 2}
    assert _fleet_gauges(_fleet_state(now, state="joining", live=[]), now)[member] == 0
    # The view grows old with the document: heartbeat 0.5 s old when the
    # document was written 9.6 s ago is past the 10 s timeout at this scrape.
    assert _fleet_gauges(_fleet_state(now - 9.4), now) == {member: 1, live: 3}
    assert _fleet_gauges(_fleet_state(now - 9.6), now) == {member: 0}
    # No heartbeat yet, a node that left, a keeper waiting for its store (the
    # document it stamps is its predecessor's): no current view.
    assert _fleet_gauges(_fleet_state(now, last_heartbeat_age_s=None), now) == {member: 0}
    assert _fleet_gauges(_fleet_state(now, state="left"), now) == {member: 0}
    waiting = _fleet_state(now)
    waiting["doc"]["trust"]["store"] = {"state": "unreachable"}
    assert _fleet_gauges(waiting, now) == {member: 0}
    # A node without a fleet (SQLite), or no state buffer: nothing.
    assert _fleet_gauges({"counts_at": now, "doc": {"trust": {"membership": None}}}, now) == {}
    assert _fleet_gauges(None, now) == {}


# -- unit: the request counter middleware -----------------------------------------------


def test_count_requests_counts_answers_and_errors():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from workers.http.errors import ApiError
    from workers.http.metrics import count_requests

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def refused(request: web.Request) -> web.Response:
        raise ApiError(400, "invalid_body", "no")

    async def run() -> None:
        app = web.Application(middlewares=[count_requests])
        app.router.add_get("/ok", ok)
        app.router.add_post("/refused", refused)
        async with TestClient(TestServer(app)) as client:
            before = Scrape(metrics.exposition().decode())
            for path, method in (("/ok", "GET"), ("/refused", "POST"), ("/nowhere", "GET")):
                await client.request(method, path)
            after = Scrape(metrics.exposition().decode())
        for labels in ({"method": "GET", "status": "200"}, {"method": "POST", "status": "400"},
                       {"method": "GET", "status": "404"}):
            name = "queue_node_http_requests_total"
            assert (after.value(name, **labels) or 0) == (before.value(name, **labels) or 0) + 1

    asyncio.run(run())


# -- acceptance: a real node ----------------------------------------------------------------


def _accounting_matches(node: NodeProcess) -> Scrape | None:
    status, acct = node.request("GET", "/accounting")
    assert status == 200
    s = scrape(node)
    got = {name: s.value(f"queue_node_{name}_total") for name in LEDGER_COUNTERS}
    want = {name: float(acct[name]) for name in LEDGER_COUNTERS}
    return (
        s
        if got == want
        and s.value("queue_node_in_flight") == acct["in_flight"]
        and s.value("queue_node_waiting") == acct["waiting"]
        else None
    )


@pytest.mark.timeout(180)
def test_metrics_has_every_contract_name_and_equals_accounting(node, tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text("[routes.pages]\ncadence_s = 3600\n")
    node.args += ["--config", str(cfg)]
    node.start()
    past = time.time() - 600
    rows = [{"key": f"p{i}", "route": "pages", "due_at": past} for i in range(4)]
    rows += [{"key": f"m{i}", "route": f"misc{i}", "due_at": past - 1200} for i in range(3)]
    assert node.request("POST", "/rows", rows)[0] == 200
    leases = _claim_exactly(node, 3)
    done, back = leases[0], leases[1]
    status, _ = node.request("POST", "/complete",
                             {"lease_id": done["lease_id"], "key": done["key"], "result": 1})
    assert status == 200
    status, _ = node.request("POST", "/release",
                             {"lease_id": back["lease_id"], "key": back["key"], "error": "boom"})
    assert status == 200

    s = wait_for(lambda: _accounting_matches(node), 20, "/metrics counters = /accounting")
    assert s.content_type.startswith("text/plain")
    missing = [name for name in CONTRACT_NAMES if not s.has(name)]
    assert missing == []
    assert s.value("queue_node_routed_total") == 3
    assert s.value("queue_node_finished_total") == 1
    assert s.value("queue_node_released_total") == 1
    assert s.value("queue_node_in_flight") == 1
    assert s.value("queue_node_held") == 1  # released with an error: a miss
    assert s.value("queue_node_parked") == 0
    assert s.value("queue_node_claim_grants_total") == 3
    assert s.value("queue_node_claim_seconds_count") >= 1
    assert s.families["queue_node_keeper_apply_seconds"].type == "histogram"
    assert s.families["queue_node_keeper_lag_seconds"].type == "histogram"

    # Route labels: the configured route and "other", never an unconfigured name.
    def lateness() -> Scrape | None:
        s = _vouched(node)
        ratios = s and s.labels("queue_node_oldest_lateness_ratio", "route")
        return s if ratios and s.value("queue_node_oldest_lateness_ratio", route="other") else None

    s = wait_for(lateness, 20, "lateness of the unconfigured routes")
    assert s.labels("queue_node_oldest_lateness_ratio", "route") == {"pages", OTHER_ROUTE}
    # misc* were due 30 minutes ago on the default cadence (1 d); pages 10
    # minutes ago on 1 h, and one of them is still due.
    assert s.value("queue_node_oldest_lateness_ratio", route="pages") >= 9 / 60
    assert 0 < s.value("queue_node_oldest_lateness_ratio", route=OTHER_ROUTE) < 1
    due = s.value("queue_node_due", kind="sitemap") + s.value("queue_node_due", kind="discovered")
    assert due >= 1
    assert node.stop() == 0


@pytest.mark.timeout(180)
def test_a_restarted_worker_still_counts_what_it_did_before(node):
    node.start()
    past = time.time() - 60
    node.request("POST", "/rows", [{"key": f"k{i}", "route": "r", "due_at": past}
                                   for i in range(8)])
    _claim_exactly(node, 3)
    before = scrape(node)
    assert before.value("queue_node_claim_grants_total") == 3
    old_worker = node.pids()["workers"][0]
    mp_dir = node.data_dir / metrics.DIR_NAME
    assert (mp_dir / f"counter_{old_worker}.db").exists()

    os.kill(old_worker, signal.SIGKILL)
    wait_for(lambda: node.pids()["workers"][0] not in (None, old_worker), 20,
             "a new worker in node.json")
    node.wait_ready()
    after = scrape(node)
    assert after.value("queue_node_claim_grants_total") == 3
    assert after.value("queue_node_claim_seconds_count") == before.value(
        "queue_node_claim_seconds_count"
    )
    # The new worker adds to what the old one counted.
    _claim_exactly(node, 2)
    assert scrape(node).value("queue_node_claim_grants_total") == 5
    assert (mp_dir / f"counter_{old_worker}.db").exists()
    assert "child_died" in node.log()
    assert node.stop() == 0


@pytest.mark.timeout(180)
def test_a_stalled_keeper_is_exported_as_unvouched_without_due(node):
    node.start()
    node.request("POST", "/rows", [{"key": "a", "route": "r", "due_at": time.time() - 60}])
    first = wait_for(lambda: _vouched(node), 20, "vouched")
    assert first.has("queue_node_due")
    keeper = node.pids()["keeper"]
    os.kill(keeper, signal.SIGSTOP)
    try:
        s = wait_for(
            lambda: (s := scrape(node)).value("queue_node_keeper_vouched") == 0 and s,
            20, "vouched 0 while the keeper is stopped",
        )
        assert "queue_node_due" not in s.families
        assert "queue_node_oldest_lateness_ratio" not in s.families
        # What does not come from the keeper is still there.
        assert s.value("queue_node_routed_total") is not None
        assert s.value("queue_node_in_flight") == 0
    finally:
        os.kill(keeper, signal.SIGCONT)
    s = wait_for(lambda: _vouched(node), 20, "vouched again after SIGCONT")
    assert s.has("queue_node_due")
    assert node.stop() == 0


def test_supervisor_owns_and_empties_the_metrics_dir(node):
    stale = node.data_dir / metrics.DIR_NAME / "counter_999999.db"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"")
    node.start()
    mp_dir = Path(node.data_dir / metrics.DIR_NAME)
    assert (os.stat(mp_dir).st_mode & 0o777) == 0o700
    assert not stale.exists()
    assert node.stop() == 0
