"""Acceptance: rows another program wrote that the node cannot hand out as
they are, and values only one of JSON and msgpack carries (a real node).

Every answer comes in JSON or in msgpack, as the request asks. Another
program may store in the file what only one of them carries: a blob (msgpack
carries bytes, JSON does not), an integer past 64 bits (JSON carries it,
msgpack does not), the text ``NaN`` (which Python's json reads as a float no
JSON answer may hold). Before: the claim that granted such a row answered
500, and every lease it had granted (the others' too) stayed leased to
nobody until it expired. Now the claim answers the others; the row that
cannot be sent is released with the reason (a miss, so it ends parked like
an item that always fails, shown in ``GET /held``); ``NaN`` is handed out as
its text, as any stored payload that is not JSON. Through the node's own
writes such payloads are refused (tests/acceptance/test_bad_input.py).

A row whose ``job`` another program set to what is not a job name (``my
job``, ``é``, a blob) was granted, and its result offered under that job,
where no ack could name it (every job in a path is checked): awaiting ack
for good. Now such a row is released with the reason, as above; a row whose
job became one during its lease delivers its result to the default job.
"""

from __future__ import annotations

import json
import sqlite3
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import pytest

from node.testing import NodeProcess, wait_for

pytestmark = pytest.mark.timeout(120)

BIG = 1 << 70
CONFIG = "max_misses = 2\n"


def _post(node: NodeProcess, path: str, body: Any, accept: str = "application/json") -> Any:
    request = urllib.request.Request(
        f"http://{node.info['http']}{path}", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Accept": accept},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as resp:  # raises for any 4xx or 5xx
        raw, kind = resp.read(), resp.headers.get_content_type()
    return msgpack.unpackb(raw) if kind == "application/msgpack" else json.loads(raw)


def _get(node: NodeProcess, path: str, accept: str = "application/json") -> Any:
    request = urllib.request.Request(f"http://{node.info['http']}{path}",
                                     headers={"Accept": accept})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as resp:
        raw = resp.read()
    return msgpack.unpackb(raw) if accept == "application/msgpack" else json.loads(raw)


def _write_outside(db: Path, rows: list[tuple], ago_s: float = 60) -> None:
    """Rows (key, payload[, due this long ago]) due ``ago_s`` ago unless
    they say, written in one transaction as another program writes the file."""
    conn = sqlite3.connect(db)
    with conn:
        conn.executemany(
            "INSERT INTO schedule (key, route, due_at, payload) VALUES (?, 'r', ?, ?)",
            [(row[0], time.time() - (row[2] if len(row) > 2 else ago_s), row[1]) for row in rows],
        )
    conn.close()


def _claim_until(
    node: NodeProcess, sent: dict[str, Any], until: Any, what: str,
    accept: str = "application/json", lease_s: float = 1,
) -> None:  # fmt: skip
    """Claim (keys and payloads into ``sent``) until ``until()`` is true."""

    def claimed() -> bool:
        body = {"max": 10, "consumer": "c", "lease_s": lease_s}
        for lease in _post(node, "/claim", body, accept)["leases"]:
            sent[lease["key"]] = lease["payload"]
        return bool(until())

    wait_for(claimed, 30, what)


def _held(node: NodeProcess) -> dict[str, dict]:
    return {hold["key"]: hold for hold in _get(node, "/held")["held"]}


@pytest.fixture
def node(tmp_path: Path, node_name: str):
    config = tmp_path / "node.toml"
    config.write_text(CONFIG)
    data = tmp_path / "data"
    data.mkdir()
    proc = NodeProcess(data, node_name, config=config).start()
    try:
        yield proc
    finally:
        proc.stop()


def test_a_payload_json_cannot_carry_is_released_with_the_reason_and_parks(node) -> None:
    _write_outside(node.data_dir / "schedule.db", [
        ("blob", b"\x00\xff"), ("nan", "NaN"), ("big", json.dumps({"n": BIG})),
        ("plain", json.dumps({"x": 1})),
    ])  # fmt: skip
    sent: dict[str, Any] = {}
    _claim_until(node, sent, lambda: {"nan", "big", "plain"} <= set(sent) and "blob" in _held(node),
                 "the other rows claimed, the blob held")  # fmt: skip
    assert "blob" not in sent
    assert sent["nan"] == "NaN"  # not JSON: handed out as its text
    assert sent["big"] == {"n": BIG} and sent["plain"] == {"x": 1}
    hold = _held(node)["blob"]
    assert hold["misses"] == 1 and not hold["parked"]
    assert "cannot be sent in JSON" in hold["last_error"]
    # Explaining the row says so too (was a 500), and msgpack carries it.
    row = _get(node, "/rows?key=blob")["row"]
    assert row["payload"] is None and "cannot be sent in JSON" in row["unsendable"]["payload"]
    assert _get(node, "/rows?key=blob", "application/msgpack")["row"]["payload"] == b"\x00\xff"

    def parked() -> bool:
        leases = _post(node, "/claim", {"max": 10, "consumer": "j", "lease_s": 1})["leases"]
        assert "blob" not in {lease["key"] for lease in leases}
        return _held(node)["blob"]["parked"]

    wait_for(parked, 30, "the blob parked after its second miss (max_misses 2)")
    assert _held(node)["blob"]["misses"] == 2
    accounting = _get(node, "/accounting")
    assert accounting["balanced"], accounting
    assert accounting["released"] == 2


def test_a_claim_msgpack_cannot_carry_comes_in_json_and_a_blob_as_bytes(node) -> None:
    """A claim asked for in msgpack whose lease msgpack cannot carry (an
    integer past 64 bits another program stored) comes in JSON, its content
    type saying so, as any answer msgpack cannot carry: before, the lease was
    released, and the row parked for a msgpack claimer, the Python client's
    default. A blob, which JSON cannot carry, in the same answer waits for a
    later one (handed back, no miss) and goes there in msgpack, as bytes."""
    db = node.data_dir / "schedule.db"
    # The big integer the most overdue: the first lease of the answer.
    _write_outside(db, [("big", json.dumps([BIG]), 120), ("blob", b"\x00\xff"), ("plain", "[1]")])
    sent: dict[str, Any] = {}
    _claim_until(node, sent, lambda: {"big", "plain", "blob"} <= set(sent),
                 "every row claimed", "application/msgpack", lease_s=60)  # fmt: skip
    assert sent == {"big": [BIG], "plain": [1], "blob": b"\x00\xff"}
    assert _held(node) == {}  # nothing missed: the blob was handed back, not released
    row = _get(node, "/rows?key=big", "application/msgpack")["row"]
    assert row["payload"] is None and "cannot be sent in msgpack" in row["unsendable"]["payload"]
    assert _get(node, "/accounting")["balanced"]


def test_a_local_claimer_refuses_a_result_msgpack_cannot_carry(node) -> None:
    """A LocalClaimer's results are polled over HTTP, in either encoding:
    the same refusal as POST /complete's, and nothing reaches the ledger."""
    from node.client import ClientError
    from node.local import LocalClaimer

    _write_outside(node.data_dir / "schedule.db", [("plain", "[1]")])
    with LocalClaimer(node.name, data_dir=node.data_dir, consumer="local") as local:
        (grant,) = wait_for(lambda: local.claim(1, 60), 30, "the row granted")
        for bad in ({"n": BIG}, ["\ud800"]):
            with pytest.raises(ClientError) as refused:
                local.complete(grant.lease_id, grant.key, bad)
            assert (refused.value.status, refused.value.code) == (400, "invalid_result")
            assert "msgpack cannot carry" in refused.value.message
        assert _get(node, "/accounting")["finished"] == 0
        assert local.complete(grant.lease_id, grant.key, {"n": 1}) > 0


def test_a_result_msgpack_cannot_carry_already_in_the_log_is_polled_in_json(node) -> None:
    """A result accepted before such results were refused (put straight into
    the ledger here, as the node took it then): a msgpack poll that reaches
    it is answered in JSON, its content type saying so, instead of a 500 on
    every poll; the Python client reads either and acks it."""
    from node.client import Client
    from node.local import LocalClaimer

    _write_outside(node.data_dir / "schedule.db", [("old-1", "[1]"), ("old-2", "[2]")])
    with LocalClaimer(node.name, data_dir=node.data_dir, consumer="local") as local:
        grants: list = []
        wait_for(lambda: grants.extend(local.claim(2, 60)) or len(grants) == 2, 30, "two grants")
        text = json.dumps({"n": BIG}).encode()
        items = [{"lease_id": g.lease_id, "key": g.key, "result": text, "encoding": "json"}
                 for g in grants]  # fmt: skip
        outcomes = local.ledger.call("complete", items=items)["outcomes"]
        assert [o["status"] for o in outcomes] == ["ok", "ok"], outcomes
    # A poll offers each result to one receiver: one here, one to the client.
    request = urllib.request.Request(f"http://{node.info['http']}/results?max=1",
                                     headers={"Accept": "application/msgpack"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("application/json")
        (result,) = json.loads(resp.read())["results"]
    assert result["result"] == {"n": BIG}
    with Client(f"http://{node.info['http']}") as client:
        (polled,) = client.poll(None, max=10)
        assert polled["result"] == {"n": BIG} and polled["id"] != result["id"]
        assert client.ack("default", [result["id"], polled["id"]]) == 2


def test_a_row_whose_job_is_not_a_job_name_is_released_and_never_stuck(node) -> None:
    from node.client import Client
    from node.local import LocalClaimer

    db = node.data_dir / "schedule.db"
    conn = sqlite3.connect(db)
    with conn:
        conn.executemany(
            "INSERT INTO schedule (key, route, due_at, job) VALUES (?, 'r', ?, ?)",
            [(key, time.time() - 60, job) for key, job in
             (("space", "my job"), ("accent", "é"), ("blob", b"\xff"), ("good", "render"))],
        )  # fmt: skip
    conn.close()
    bad = {"space", "accent", "blob"}
    with Client(f"http://{node.info['http']}") as client, LocalClaimer(
        node.name, data_dir=node.data_dir, consumer="local"
    ) as local:
        granted: dict[str, Any] = {}

        def claimed() -> bool:
            for grant in [*client.claim(10, 1, "http"), *local.claim(10, 1)]:
                granted[grant.key] = grant
            return "good" in granted and bad <= set(_held(node))

        wait_for(claimed, 30, "the good row granted, the others held")
        assert set(granted) == {"good"}, granted
        for key in bad:
            assert "is not a job name" in _held(node)[key]["last_error"]
        # A job that stops being a job name during a lease: its result goes
        # to the default job, where it can be acked.
        lease = wait_for(lambda: local.claim(1, 60) or None, 30, "the good row again")[0]
        conn = sqlite3.connect(db)
        with conn:
            conn.execute("UPDATE schedule SET job = 'not one' WHERE key = 'good'")
        conn.close()
        result_id = local.complete(lease.lease_id, lease.key, {"done": 1})
        (result,) = client.poll("default", max=10, wait_s=10)
        assert (result["id"], result["job"], result["key"]) == (result_id, "default", "good")
        assert client.ack("default", [result_id]) == 1
    accounting = _get(node, "/accounting")
    assert accounting["balanced"] and accounting["awaiting_ack"] == 0, accounting


BAD_KEYS = [b"\xff\xfe", "", "k" * 1025, "é" * 513]  # a blob, empty, 1,025 and 1,026 bytes


def test_rows_whose_keys_the_node_cannot_hold_are_skipped_on_load_and_in_the_feed(node) -> None:
    """Another program's keys that are no key of the node's (a blob, an empty
    or an over-long text). Before: a blob key in the file made the keeper's
    load compare str with bytes and exit, restarted by the supervisor into
    the same load, for good (the node never live). Now they are counted
    unreadable on the load, as invalid changes in the feed, and the others
    are served."""
    db = node.data_dir / "schedule.db"
    node.stop()
    _write_outside(db, [(key, None) for key in BAD_KEYS] + [("good-1", None)])
    node.start()
    keeper_pid = node.node_json()["pids"]["keeper"]
    state = wait_for(lambda: (s := _get(node, "/queue-state"))["trust"]["vouched"] and s, 30,
                     "the node live and vouching")  # fmt: skip
    assert state["trust"]["load"]["unreadable"] == len(BAD_KEYS)
    later_bad = [b"\xfe", "k" * 1030, "é" * 600]  # the feed's (the empty key is taken)
    _write_outside(db, [(key, None) for key in later_bad] + [("good-2", None)])
    granted: set[str] = set()

    def claimed() -> bool:
        body = {"max": 10, "consumer": "c", "lease_s": 60}
        granted.update(x["key"] for x in _post(node, "/claim", body)["leases"])
        return {"good-1", "good-2"} <= granted

    wait_for(claimed, 30, "both good rows granted")
    assert granted == {"good-1", "good-2"}
    assert node.node_json()["pids"]["keeper"] == keeper_pid  # the keeper never restarted
    assert _get(node, "/accounting")["balanced"]


def test_text_another_program_stored_that_is_not_utf8(node) -> None:
    """SQLite keeps any bytes as TEXT. Before: a key or route that is not
    UTF-8 stopped the keeper's feed for good (every read of the change log
    raised: the node stayed not exact, nothing written after it was
    scheduled); a job or payload that is not UTF-8 left its row due and
    never granted. Now: such a key or route is a row nobody can schedule
    (left out, the feed goes on); a payload is handed out as its bytes; a
    job is no job name (released with the reason)."""
    conn = sqlite3.connect(node.data_dir / "schedule.db")
    now = time.time() - 60
    insert = "INSERT INTO schedule (key, route, job, payload, due_at) VALUES ({}, ?)"
    with conn:
        for values in (
            "CAST(X'FF41' AS TEXT), 'r', 'j', NULL",  # a key that is not UTF-8
            "'route', CAST(X'FF42' AS TEXT), 'j', NULL",
            "'job', 'r', CAST(X'FF43' AS TEXT), NULL",
            "'payload', 'r', 'j', CAST(X'FF44' AS TEXT)",
            "'plain', 'r', 'j', NULL",
        ):
            conn.execute(insert.format(values), (now,))
    conn.close()
    keeper_pid = node.node_json()["pids"]["keeper"]
    sent: dict[str, Any] = {}
    _claim_until(node, sent, lambda: {"plain", "payload"} <= set(sent) and "job" in _held(node),
                 "the rows granted or held", "application/msgpack", lease_s=60)  # fmt: skip
    assert set(sent) == {"plain", "payload"} and sent["payload"] == b"\xffD"
    assert "is not a job name" in _held(node)["job"]["last_error"]
    state = _get(node, "/queue-state")
    assert state["trust"]["vouched"] and state["trust"]["exact"], state["trust"]
    row = _get(node, "/rows?key=job")["row"]
    assert row["job"] is None and "cannot be sent in JSON" in row["unsendable"]["job"]
    assert node.node_json()["pids"]["keeper"] == keeper_pid
    assert _get(node, "/accounting")["balanced"]
