"""Acceptance: the console's fleet view (issue 19, item 3; docs/console.md,
"The fleet"), in a real headless Chromium against two real nodes on one
PostgreSQL database with a token: both nodes side by side with their own
figures, a node paused and resumed through the other one's page, a route run
again now from the page (after its confirm step), a node killed shown as
down, the fleet not summed and the node that answered shown with its own
figures, a page opened after the node died listing it as down from its
first draw, and a forgotten node not shown. The browser fixture is
test_console.py's."""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest

from node.fleet import Membership
from node.store.postgres import PostgresStore
from node.testing import NodeProcess, finish, wait_for
from tests import pg
from tests.acceptance.test_console import _severe, _text, browser  # noqa: F401 - a fixture

TOKEN = f"fleet-console-{uuid.uuid4().hex}"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FLEET_ENV = {
    "QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": "4",
    "QUEUE_NODE_HEARTBEAT_S": "0.2",
    "QUEUE_NODE_STATE_INTERVAL_S": "0.5",
    "QUEUE_NODE_TOKEN": TOKEN,
}
DUE, LATER = 40, 30


def _get(node: NodeProcess, path: str) -> tuple[int, Any]:
    try:
        return node.request("GET", path, headers=AUTH, timeout_s=10)
    except OSError as exc:
        return 0, {"error": str(exc)}


def _cluster(node: NodeProcess, names: list[str], due: int | None = None) -> Any:
    status, doc = _get(node, "/queue-state?scope=cluster")
    if status != 200 or doc.get("nodes") != names:
        return None
    return doc if due is None or doc["now"]["due"]["total"] == due else None


def _seed(pg_url: str) -> None:
    now = time.time()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at)"
            " SELECT 'p' || i, 'pages', 3600, %s FROM generate_series(1, %s) AS i",
            (now - 600, DUE),
        )
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at)"
            " SELECT 'l' || i, 'later', 86400, %s FROM generate_series(1, %s) AS i",
            (now + 7200, LATER),
        )


def _row(driver: Any, name: str) -> Any:
    from selenium.webdriver.common.by import By

    rows = driver.find_elements(
        By.CSS_SELECTOR, f'tr[data-testid="fleet-node"][data-node="{name}"]'
    )
    return rows[0] if rows else None


def _row_state(driver: Any, name: str) -> str | None:
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        row = _row(driver, name)
        return None if row is None else row.get_attribute("data-state")
    except StaleElementReferenceException:
        return None  # redrawn under us: ask again


def _cell(driver: Any, name: str, testid: str) -> str | None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        row = _row(driver, name)
        return (
            None
            if row is None
            else row.find_element(By.CSS_SELECTOR, f'[data-testid="{testid}"]').text
        )
    except StaleElementReferenceException:
        return None


def _click(driver: Any, name: str, testid: str) -> bool:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        _row(driver, name).find_element(By.CSS_SELECTOR, f'[data-testid="{testid}"]').click()
    except (StaleElementReferenceException, AttributeError):
        return False
    return True


# Every node row of the fleet table as one render drew it (one script: the
# page cannot redraw while it runs): name -> (state, state text, due).
_ROWS_JS = """
return Array.from(document.querySelectorAll('tr[data-testid="fleet-node"]')).map((tr) => [
  tr.dataset.node, tr.dataset.state,
  tr.querySelector('[data-testid="fleet-node-state"]').textContent,
  tr.querySelector('[data-testid="fleet-node-due"]').textContent]);
"""


def _rows(driver: Any) -> dict[str, tuple[str, str, str]]:
    return {name: (state, text, due) for name, state, text, due in driver.execute_script(_ROWS_JS)}


def _paused(node: NodeProcess) -> bool | None:
    status, doc = _get(node, "/queue-state")
    return doc["now"]["paused"]["node"] if status == 200 else None


@pytest.mark.timeout(120)
def test_fleet_view_in_a_real_browser(tmp_path, pg_url, browser) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    _seed(pg_url)
    names = sorted(f"cf-{uuid.uuid4().hex[:8]}" for _ in range(2))
    a, b = (NodeProcess(tmp_path / n, n, "--store", pg_url, env=FLEET_ENV) for n in names)
    try:
        a.start()
        b.start()
        doc = wait_for(lambda: _cluster(a, names, DUE), 60, "the fleet summed over both")

        # 1. Both nodes side by side, with the figures the cluster answer gives.
        browser.get(a.base_url + "/")
        browser.find_element(By.ID, "token-input").send_keys(TOKEN)
        browser.find_element(By.ID, "token-save").click()
        wait_for(lambda: all(_row_state(browser, n) == "vouched" for n in names), 20,
                 "both nodes listed as vouched")  # fmt: skip
        wait_for(lambda: _text(browser, "fleet-due") == str(DUE), 10, "the fleet's due total")
        assert _severe(browser, allowed=("status of 401",)) == []  # the reads before the token
        assert _text(browser, "fleet-summary").startswith("summed over 2 nodes")
        doc = wait_for(lambda: _cluster(a, names, DUE), 10, "the fleet summed")
        for name in names:
            own = doc["trust"]["nodes"][name]
            wait_for(lambda n=name, o=own: _cell(browser, n, "fleet-node-due") == str(o["due"]),
                     10, f"{name}'s own due count")  # fmt: skip
            assert "balanced" in _cell(browser, name, "fleet-node-output-law")
        assert sum(doc["trust"]["nodes"][n]["due"] for n in names) == DUE
        wait_for(lambda: _text(browser, "fleet-balanced").startswith("balanced"), 10, "books")

        # 2. Pause b through a's page: b's own keeper has it; then resume.
        wait_for(lambda: _click(browser, b.name, "fleet-pause"), 10, "b's pause button")
        wait_for(lambda: _paused(b) is True, 15, "b paused")
        assert _paused(a) is False
        wait_for(lambda: _cell(browser, b.name, "fleet-node-paused") == "node", 10, "shown")
        assert f"Paused node {b.name}" in _text(browser, "fleet-message")
        wait_for(lambda: _click(browser, b.name, "fleet-resume"), 10, "b's resume button")
        wait_for(lambda: _paused(b) is False, 15, "b resumed")

        # 3. Run the route "later" again now: asked, confirmed, its rows due
        # on whichever node holds them.
        browser.find_element(By.ID, "fleet-target").send_keys("later")
        browser.find_element(By.ID, "fleet-run-now").click()
        confirm = browser.find_element(By.ID, "fleet-confirm")
        assert confirm.is_displayed()
        assert "route later" in _text(browser, "fleet-confirm-text")
        assert wait_for(lambda: _cluster(a, names), 5, "still summed")["now"]["due"]["total"] == DUE
        browser.find_element(By.ID, "fleet-confirm-yes").click()
        wait_for(lambda: _cluster(a, names, DUE + LATER), 20, "the route's rows due, fleet-wide")
        assert f"{LATER} rows of route later due now" in _text(browser, "fleet-message")
        wait_for(lambda: _text(browser, "fleet-due") == str(DUE + LATER), 10, "shown")
        assert _severe(browser) == []

        # 4. b dies: not summed, b marked down, and a (which answered)
        # shown with its own figures, no total; once b's membership lapses,
        # a alone holds every row and b is listed as down, off the list.
        b.kill()
        own_due = str(_get(a, "/queue-state")[1]["now"]["due"]["total"])

        def shown_apart() -> dict | None:
            rows = _rows(browser)
            if rows.get(b.name, ("",))[0] != "down" or rows.get(a.name, ("",))[0] != "waiting":
                return None
            return rows

        rows = wait_for(shown_apart, 20, "b shown down, a apart")
        assert rows[a.name][2] == own_due != "–", rows  # a's own due: the same as its own answer
        assert _text(browser, "fleet-summary").startswith("not summed: node " + b.name)
        assert _text(browser, "fleet-due") == "–"  # never a partial sum
        # Over HTTP: a pause for the dead node is 503, for a name not on the
        # node list 404; nothing is forwarded.
        status, body = a.request("POST", "/admin/pause", {"node": b.name}, headers=AUTH)
        assert status == 503 and body["error"]["code"] == "peer_unavailable", body
        assert b.name in body["error"]["message"]
        status, body = a.request("POST", "/admin/pause", {"node": "no-such-node"}, headers=AUTH)
        assert status == 404 and body["error"]["code"] == "unknown_node", body
        assert _paused(a) is False
        wait_for(lambda: "no heartbeat" in (_cell(browser, b.name, "fleet-node-state") or ""),
                 30, "b listed as down, off the live list")  # fmt: skip
        # a takes b's rows up (a walk): it may not vouch for a moment.
        wait_for(lambda: _row_state(browser, a.name) == "vouched", 30, "a alone, vouched")
        wait_for(lambda: _text(browser, "fleet-due") == str(DUE + LATER), 30, "every row on a")
        assert _severe(browser, allowed=("status of 503",)) == []

        # 5. A page opened after b died lists b as down from its first draw
        # (the node list knows it; this page never saw it live).
        browser.refresh()  # the token stays: sessionStorage
        rows = wait_for(lambda: _rows(browser) or None, 20, "the first draw of the fleet")
        assert rows[b.name][0] == "down" and "no heartbeat" in rows[b.name][1], rows
        assert rows[a.name][0] in ("vouched", "not-vouching"), rows
        # Forgotten (its row deleted): on no list, not shown.
        with Membership(pg_url, a.name, "", membership_timeout_s=4) as membership:
            assert membership.forget(b.name)
        wait_for(lambda: b.name not in _rows(browser), 10, "b forgotten, not shown")
        assert _severe(browser, allowed=("status of 503",)) == []
    finally:
        finish([a, b], names[0])
        finish([a, b], names[1])
