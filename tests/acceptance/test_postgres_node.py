"""Acceptance: ``python -m node run --store postgresql://…`` runs one node on
PostgreSQL end to end (issue 18, item 1): the keeper loads from the database
and follows its change log, POST /rows writes to it, claims grant, completions
write back under the version guard, the results are delivered and acked, and
both sides of the books balance. A password in ``--store`` is never shown: not
in ``ps``, ``node.json``, the run's configuration, nor the log."""

from __future__ import annotations

import time

import psutil
import psycopg
import pytest

from node.client import LocalClaimer
from node.store.postgres import PostgresStore
from node.testing import NodeProcess, finish, wait_for
from tests import pg

pytestmark = pytest.mark.timeout(180)

# Trust authentication (the test server) ignores it; the node must still hide it.
PASSWORD = "n0t-to-be-shown"


@pytest.fixture
def node(tmp_path, node_name, pg_url):
    PostgresStore(pg_url).close()  # the schema, in a database new to this run
    pg.reset(pg_url)
    with_password = pg_url.replace("postgres@", f"postgres:{PASSWORD}@", 1)
    proc = NodeProcess(tmp_path / "data", node_name, "--store", with_password)
    yield proc
    finish([proc], node_name)


def _node_processes(node: NodeProcess) -> list[psutil.Process]:
    top = psutil.Process(node.proc.pid)
    return [top, *top.children(recursive=True)]


def test_a_node_runs_on_postgresql_end_to_end(node, pg_url):
    # A row written before the start: the keeper's load walk finds it.
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at) VALUES ('before', 'r', 3600, %s)",
            (time.time() - 60,),
        )
    node.start()
    now = time.time()
    rows = [{"key": f"k{i}", "route": "r", "cadence_s": 3600, "due_at": now - 60}
            for i in range(20)]  # fmt: skip
    assert node.request("POST", "/rows", rows) == (200, {"upserted": 20})
    keys = {"before", *(r["key"] for r in rows)}

    leases: dict[str, int] = {}

    def claim_all() -> bool:
        status, body = node.request(
            "POST", "/claim", {"max": 50, "consumer": "gpu", "lease_s": 600}
        )
        assert status == 200, body
        leases.update({x["key"]: x["lease_id"] for x in body["leases"]})
        return set(leases) == keys

    wait_for(claim_all, 30, "every due row granted")
    for key, lease_id in leases.items():
        status, body = node.request(
            "POST", "/complete", {"lease_id": lease_id, "key": key, "result": key.upper()}
        )
        assert status == 200, body

    def delivered() -> list:
        status, body = node.request("GET", "/jobs/default/results?max=100")
        assert status == 200, body
        return body["results"] if len(body["results"]) == len(keys) else []

    results = wait_for(delivered, 30, "every result offered")
    assert sorted(r["key"] for r in results) == sorted(keys)
    assert all(r["result"] == r["key"].upper() for r in results)
    ids = [r["id"] for r in results]
    assert node.request("POST", "/jobs/default/ack", {"ids": ids}) == (200, {"acked": len(keys)})

    # The write-backs reached the database: each row's next due time an hour
    # on, and its outcome.
    def written_back() -> bool:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            found = conn.execute(
                "SELECT count(*) FROM schedule WHERE last_result_id IS NOT NULL"
                " AND due_at > %s", (now + 3000,)
            ).fetchone()[0]
        return found == len(keys)

    wait_for(written_back, 30, "every completion written back")

    def balanced() -> dict | None:
        status, accounting = node.request("GET", "/accounting")
        assert status == 200, accounting
        return accounting if accounting["balanced"] and accounting["acknowledged"] else None

    accounting = wait_for(balanced, 30, "the books balanced")
    assert accounting["routed"] == accounting["finished"] == accounting["acknowledged"]
    assert accounting["acknowledged"] == len(keys)

    # A GPU process's LocalClaimer (shared memory, its rows read from PostgreSQL).
    later = [{"key": f"local{i}", "route": "r", "due_at": time.time() - 60} for i in range(5)]
    assert node.request("POST", "/rows", later) == (200, {"upserted": 5})
    local_keys: set[str] = set()
    with LocalClaimer(node.name, data_dir=str(node.data_dir), consumer="local") as local:
        def claimed_locally() -> bool:
            local_keys.update(g.key for g in local.claim(5, lease_s=600, wait_s=0.2))
            return local_keys == {r["key"] for r in later}

        wait_for(claimed_locally, 30, "the later rows granted to a LocalClaimer")

    # The password: in no process's command line, nor in any file the node wrote.
    for proc in _node_processes(node):
        assert PASSWORD not in " ".join(proc.cmdline()), proc.cmdline()
    for path in node.data_dir.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".log", ""):
            assert PASSWORD.encode() not in path.read_bytes(), path
    assert node.stop() == 0
    assert PASSWORD not in node.log()
