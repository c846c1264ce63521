"""The row service (``workers/rows``) in process, on this run's PostgreSQL
database: a read through it gives the claim path the rows the store gives,
row for row (a bad row as a BadRow, a missing key as nothing); a request it
cannot take is refused, not guessed at; and a service that is gone, or whose
store fails, is ``StoreUnavailable`` to the claim path, as the store's own
failure is."""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid

import psycopg
import pytest

from node.core.errors import StoreError, StoreUnavailable
from node.core.names import rows_address
from node.core.rows import RowWrite
from node.ipc import IpcClient, RemoteError
from node.store import BadRow
from node.store.postgres import PostgresStore
from tests import pg
from workers.rows import RowsClient
from workers.rows.service import RowService

pytestmark = pytest.mark.timeout(30)

NOW = 1_700_000_000.0


class _Failing:
    """A store whose reads fail as a server that went away makes them fail."""

    def __init__(self, exc: StoreError) -> None:
        self.exc = exc

    def claim_rows(self, keys: list[str]) -> list[tuple]:
        raise self.exc


@pytest.fixture
def store(pg_url):
    pg.reset(pg_url)
    s = PostgresStore(pg_url)
    yield s
    s.close()


@pytest.fixture
def serve():
    """Start a service on a fresh name: ``serve(store) -> RowsClient``."""
    started: list[tuple[RowService, threading.Thread, int, int]] = []

    def start(backing) -> RowsClient:
        name = f"t-{uuid.uuid4().hex[:12]}"
        service = RowService(name, backing)
        rfd, wfd = os.pipe2(os.O_NONBLOCK)  # as the process makes it
        thread = threading.Thread(target=service.serve, args=(rfd,), daemon=True)
        thread.start()
        started.append((service, thread, rfd, wfd))
        return RowsClient(name, timeout_s=5)

    yield start
    for service, thread, rfd, wfd in started:
        service.stop()
        os.write(wfd, b"x")  # as a signal's wake-up byte ends its select
        thread.join(5)
        os.close(rfd)
        os.close(wfd)


def _without_outcome(row):
    if isinstance(row, BadRow):
        return (row.key, row.version, row.reason)
    return dataclasses.replace(row, last_result_id=None, last_finished_at=None, last_error=None)


def test_the_rows_read_through_it_are_the_stores(store, serve, pg_url):
    store.upsert(
        [
            RowWrite("a", "r", cadence_s=600, due_at=NOW, payload={"n": 1}, job="j"),
            RowWrite("b", "r", sitemap=True, due_at=NOW + 0.125),
            RowWrite("c\u00e9", "s", cadence_s=3600, due_at=NOW - 1, payload=[1, "x", None]),
        ],
        now=NOW,
    )
    with psycopg.connect(pg_url, autocommit=True) as conn:
        # A row another program wrote that the keeper cannot schedule; an outcome.
        conn.execute(
            "INSERT INTO schedule (key, route, cadence_s, due_at) VALUES ('bad', 'r', 5, 1)"
        )
        conn.execute("UPDATE schedule SET last_error = 'boom' WHERE key = 'a'")
    client = serve(store)
    keys = ["a", "b", "c\u00e9", "bad", "missing"]
    got = client.get_many(keys)
    want = store.get_many(keys)
    assert set(got) == set(want) == {"a", "b", "c\u00e9", "bad"}
    assert {k: _without_outcome(r) for k, r in got.items()} == {
        k: _without_outcome(r) for k, r in want.items()
    }
    assert client.get("missing") is None
    assert _without_outcome(client.get("a")) == _without_outcome(store.get("a"))
    assert client.get_many([]) == {}
    assert client.claim_source() is None
    client.close()


def test_a_request_it_cannot_take_is_refused(store, serve):
    client = serve(store)
    raw = IpcClient(rows_address(client.name), timeout_s=5)
    for fields in ({"op": "nope"}, {"op": "rows", "keys": "a"}, {"op": "rows", "keys": [1]}):
        op = fields.pop("op")
        with pytest.raises(RemoteError) as caught:
            raw.call(op, **fields)
        assert caught.value.code == "bad_request"
    raw.close()


def test_a_failing_store_or_no_service_is_store_unavailable(serve):
    down = serve(_Failing(StoreUnavailable("PostgreSQL store: claim_rows: connection refused")))
    with pytest.raises(StoreUnavailable, match="connection refused"):
        down.get_many(["a"])
    down.close()
    broken = serve(_Failing(StoreError("PostgreSQL store: claim_rows: syntax")))
    with pytest.raises(StoreError, match="syntax") as caught:
        broken.get_many(["a"])
    assert not isinstance(caught.value, StoreUnavailable)
    broken.close()
    nobody = RowsClient(f"t-{uuid.uuid4().hex[:12]}", timeout_s=5)
    with pytest.raises(StoreUnavailable, match="row service") as gone:
        nobody.get_many(["a"])
    assert "\0" not in str(gone.value)
    nobody.close()
