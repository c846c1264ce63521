"""Acceptance: on a PostgreSQL node the claim path reads its rows through the
node's row service (``workers/rows``), so a GPU process that claims holds no
PostgreSQL connection of its own (issue 18, item 1; docs/postgres.md,
"Connections"); and the claims fail clearly while the service is down and
recover when the supervisor has started it again (a real kill -9)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from node.client import LocalClaimer
from node.core.errors import ClientError
from node.store.postgres import PostgresStore
from node.testing import NodeProcess, finish, wait_for
from tests import pg

pytestmark = pytest.mark.timeout(120)

ROWS = 20


@pytest.fixture
def node(tmp_path, node_name, pg_url):
    PostgresStore(pg_url).close()  # the schema, in a database new to this run
    pg.reset(pg_url)
    proc = NodeProcess(tmp_path / "data", node_name, "--store", pg_url, "--workers", "1")
    yield proc
    finish([proc], node_name)


def _pg_connections_of_this_process(pg_url: str) -> list:
    """This process's TCP connections to the PostgreSQL server."""
    port = int(conninfo_to_dict(pg_url).get("port") or 5432)
    return [
        c
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    ]


def _due_rows(node: NodeProcess, prefix: str) -> set[str]:
    now = time.time()
    rows = [{"key": f"{prefix}{i}", "route": "r", "cadence_s": 3600, "due_at": now - 60}
            for i in range(ROWS)]  # fmt: skip
    assert node.request("POST", "/rows", rows) == (200, {"upserted": ROWS})
    return {r["key"] for r in rows}


def test_a_local_claimer_on_postgresql_holds_no_connection_and_skips_stale_rows(node, pg_url):
    node.start()
    keys = _due_rows(node, "k")
    assert not _pg_connections_of_this_process(pg_url)  # the test's own are closed
    keeper = psutil.Process(node.pids()["keeper"])
    with LocalClaimer(node.name, data_dir=str(node.data_dir), consumer="gpu") as local:
        wait_for(
            lambda: {e.key for e in local.ready.snapshot().entries} == keys,
            30,
            "every row in the ready set",
        )
        # The set stays as published (the keeper stopped): one of its rows
        # deleted and one rewritten since are read through the service, and
        # skipped by the claim's checks as they are on the store.
        keeper.suspend()
        try:
            with psycopg.connect(pg_url, autocommit=True) as conn:
                conn.execute("DELETE FROM schedule WHERE key = 'k0'")
                conn.execute("UPDATE schedule SET payload = '{\"n\": 1}' WHERE key = 'k1'")
            grants = local.claim(ROWS, lease_s=600)
        finally:
            keeper.resume()
        assert {g.key for g in grants} == keys - {"k0", "k1"}
        stats = local.claimer.stats
        assert (stats.gone, stats.moved) == (1, 1)
        results = local.complete_many([(g.lease_id, g.key, g.key.upper()) for g in grants])
        assert all(isinstance(r, int) for r in results), results
        # Claimed and completed, and not one PostgreSQL connection of its own.
        assert not _pg_connections_of_this_process(pg_url)
    # The service's connections are the ones that read the rows: the server
    # sees them from the service's pid, none from this one.
    with psycopg.connect(pg_url, autocommit=True) as conn:
        ports = {
            port
            for (port,) in conn.execute(
                "SELECT client_port FROM pg_stat_activity WHERE datname = current_database()"
            ).fetchall()
        }
    rows_pid = node.pids()["rows"]
    service_ports = {
        c.laddr.port for c in psutil.Process(rows_pid).net_connections(kind="tcp") if c.raddr
    }
    assert service_ports & ports
    assert node.stop() == 0


def test_claims_fail_clearly_while_the_row_service_is_down_and_recover(node):
    node.start()
    _due_rows(node, "k")
    supervisor = psutil.Process(node.proc.pid)
    with LocalClaimer(node.name, data_dir=str(node.data_dir), consumer="gpu") as local:
        wait_for(lambda: local.claim(2, lease_s=600, wait_s=0.2), 30, "a first grant")
        old_pid = node.pids()["rows"]
        # The supervisor held still: the service stays down until it resumes.
        supervisor.suspend()
        try:
            os.kill(old_pid, signal.SIGKILL)
            wait_for(
                lambda: psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE,
                10,
                "the row service dead",
            )
            for _ in range(2):  # its broken connection, then no service to connect to
                with pytest.raises(ClientError) as caught:
                    local.claim(2, lease_s=600)
                assert (caught.value.status, caught.value.code) == (503, "store_unavailable")
                assert "row service" in caught.value.message
            status, body = node.request("POST", "/claim", {"max": 2, "consumer": "http"})
            assert (status, body["error"]["code"]) == (503, "store_unavailable"), body
        finally:
            supervisor.resume()

        def granted() -> list:
            try:
                return local.claim(2, lease_s=600, wait_s=0.2)
            except ClientError as exc:
                assert exc.code == "store_unavailable", exc
                return []

        wait_for(granted, 30, "grants again once the service is back")
    assert node.pids()["rows"] != old_pid  # the supervisor started it again
    assert node.stop() == 0


FAST_FLEET = {"QUEUE_NODE_MEMBERSHIP_TIMEOUT_S": "2", "QUEUE_NODE_HEARTBEAT_S": "0.2"}


def test_a_claim_whose_row_read_outlasts_the_grant_deadline_grants_nothing(tmp_path, node_name,
                                                                           pg_url):  # fmt: skip
    """The row service held (SIGSTOP) while a claim's take has passed its
    deadline check and waits for its rows; the keeper held too, so no
    heartbeat renews the deadline (membership timeout 2 s: it passes 1.6 s
    after the last heartbeat). The claim gives the read up at the deadline
    and is refused, ``not_granting``, while the service is still held, and
    nothing is leased (docs/fleet.md, "The grant deadline"). Without the
    checks after the read it granted every row past the deadline once the
    service answered; without the read's bound it waited for the service."""
    import threading

    PostgresStore(pg_url).close()
    pg.reset(pg_url)
    node = NodeProcess(tmp_path / "data", node_name, "--store", pg_url, "--workers", "1",
                       env=FAST_FLEET)  # fmt: skip
    try:
        node.start()
        keys = _due_rows(node, "d")
        rows = psutil.Process(node.pids()["rows"])
        keeper = psutil.Process(node.pids()["keeper"])
        with LocalClaimer(node.name, data_dir=str(node.data_dir), consumer="gpu") as local:
            wait_for(lambda: {e.key for e in local.ready.snapshot().entries} == keys, 30,
                     "every row in the ready set")  # fmt: skip
            left = local.ready.remaining()
            outcome: list = []

            def claim() -> None:
                try:
                    outcome.append(local.claim(ROWS, lease_s=600))
                except ClientError as exc:
                    outcome.append(exc)

            # The read's own timeout (10 s) past this test's wait: only the
            # deadline can end the held read in time.
            local.claimer.store._ipc.timeout_s = 120.0
            claimer = threading.Thread(target=claim, daemon=True)
            held = [rows]
            rows.suspend()
            try:
                claimer.start()
                # Taken (the cursor moved): the claim is past its take's
                # check and waits for the held service's answer.
                wait_for(lambda: local.ready.remaining() < left, 10, "the claim's take")
                keeper.suspend()
                held.append(keeper)
                # The read is given up at the deadline: the claim comes
                # back while the service is still held.
                claimer.join(30)
                assert not claimer.is_alive(), "the claim never came back"
                assert time.monotonic_ns() > local.ready.grant_until_ns
                assert rows.status() == psutil.STATUS_STOPPED
                rows.resume()
                assert local.claimer.leases.live() == [], "leased past the grant deadline"
            finally:
                for process in held:
                    process.resume()
        assert len(outcome) == 1 and isinstance(outcome[0], ClientError), outcome
        assert outcome[0].code == "not_granting", outcome[0]
    finally:
        finish([node], node_name)
