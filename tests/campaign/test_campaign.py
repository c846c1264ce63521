"""The fault campaign (tests/campaign/, docs/reliability.md).

- The checker is a plain function over logs: made-up logs show it passes a
  clean history, names the window of each explained duplicate, and FAILS on
  a lost item, an unexpected id, an unexplained duplicate and an unbalanced
  ledger.
- The schedule is a pure function of its seed and covers every fault kind.
- The short campaign (default run): a real node, a producer, inference
  processes and an outside consumer, and 12 faults from a fixed seed, one of
  each kind; the checker must pass.
- The long campaign (``--run-slow``): more items and faults, and the variant
  whose full disk is a real small filesystem (a tmpfs, where this user may
  mount one).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from node.testing import NodeProcess, finish, wait_for
from tests.campaign import checker
from tests.campaign.nemesis import KINDS, mount_tmpfs, schedule, umount
from tests.campaign.run import Settings, report, run

NOW = 1_800_000_000.0
CADENCE = 30 * 86400


# -- made-up histories -----------------------------------------------------------------


def _offer(t: float, rid: int, item: int, job: str = "a") -> dict[str, Any]:
    result = {"id": item, "nonce": f"n{rid}", "by": "outside"}
    return {"t": t, "ev": "offer", "rid": rid, "key": f"c/{item:06d}", "job": job,
            "result": result}  # fmt: skip


def _ack(t: float, *rids: int, job: str = "a") -> dict[str, Any]:
    return {"t": t, "ev": "ack", "job": job, "ids": list(rids), "sent": t, "acked": len(rids)}


def _history(n: int = 3) -> dict[str, Any]:
    """Items 0..n-1 written, each finished once (result id 100 + item),
    offered and acked; the table written back; the ledger balanced."""
    consumer = []
    for i in range(n):
        consumer += [_offer(NOW + i, 100 + i, i), _ack(NOW + i + 0.1, 100 + i)]
    return {
        "producer": [{"t": NOW - 1, "ev": "write", "ids": list(range(n)), "outcome": "ok"}],
        "consumer": consumer,
        "runs": [],
        "table": {f"c/{i:06d}": NOW + CADENCE for i in range(n)},
        "accounting": {"balanced": True, "routed": n, "finished": n, "expired": 0,
                       "released": 0, "in_flight": 0, "acknowledged": n, "awaiting_ack": 0,
                       "gaps": {"input": 0, "input_bound": 0, "output": 0}},
        "faults": [],
        "node_events": [],
        "offer_timeout_s": 3.0,
        "ended_at": NOW + 100,
    }  # fmt: skip


def _check(h: dict[str, Any]) -> checker.Verdict:
    return checker.check(checker.Evidence(**h))


def test_the_checker_fails_a_history_whose_input_side_does_not_balance():
    h = _history()
    h["accounting"]["gaps"]["input"] = 1  # a due key neither routed, withdrawn nor waiting
    v = _check(h)
    assert not v.ok
    assert any("input side" in p for p in v.problems), v.problems


def test_the_checker_passes_a_clean_history():
    v = _check(_history())
    assert v.ok, v.table()
    assert v.counts["written"] == v.counts["finished"] == v.counts["acknowledged"] == 3
    assert (v.counts["lost"], v.counts["unexpected"], v.counts["duplicated"]) == (0, 0, 0)
    assert "PASS" in v.table()


def test_the_checker_fails_on_a_lost_item():
    h = _history()
    h["consumer"] = [r for r in h["consumer"] if r.get("rid") != 101 and r.get("ids") != [101]]
    h["accounting"].update(routed=2, finished=2, acknowledged=2)
    v = _check(h)
    assert not v.ok and v.counts["lost"] == 1
    assert any("lost: item 1 never finished" in p for p in v.problems), v.problems
    assert "FAIL" in v.table()


def test_the_checker_fails_on_a_result_never_acknowledged_or_never_offered():
    h = _history()
    h["consumer"] = [r for r in h["consumer"] if r.get("ids") != [102]]
    h["consumer"].append({"t": NOW + 9, "ev": "complete", "key": "c/000007", "rid": 999})
    v = _check(h)
    assert v.counts["lost"] == 2, v.problems
    assert any("item 2 finished, never acknowledged" in p for p in v.problems)
    assert any("result 999" in p and "never offered" in p for p in v.problems)


def test_the_checker_fails_on_an_unexpected_id():
    h = _history()
    h["consumer"] += [_offer(NOW + 5, 200, 42), _ack(NOW + 5.1, 200)]
    h["accounting"].update(routed=4, finished=4, acknowledged=4)
    v = _check(h)
    assert not v.ok and v.counts["unexpected"] == 1
    assert any("item 42 was never written" in p for p in v.problems), v.problems


def test_the_checker_fails_on_a_result_that_names_another_item():
    h = _history()
    h["consumer"][0]["result"]["id"] = 2
    v = _check(h)
    assert not v.ok and v.counts["unexpected"] == 1, v.problems


def test_the_checker_fails_on_an_unexplained_redelivery():
    h = _history()
    # Offered again 0.05 s later with no ack, no restart: no window explains it.
    h["consumer"].insert(1, _offer(NOW + 0.05, 100, 0))
    v = _check(h)
    assert not v.ok and v.counts["duplicated"] == 1
    assert v.duplicates[0].window == checker.UNEXPLAINED
    assert any("unexplained duplicate: item 0" in p for p in v.problems), v.problems


def test_the_checker_fails_on_a_redelivery_after_an_answered_ack():
    h = _history()
    h["consumer"].append(_offer(NOW + 50, 100, 0))  # acked at NOW + 0.1, offered again
    h["node_events"] = [(NOW + 20, "ledger", "ledger_serving", "")]  # a restart, no disk fault
    v = _check(h)
    assert not v.ok and v.duplicates[0].window == checker.UNEXPLAINED


def test_the_checker_fails_on_an_unexplained_second_result():
    h = _history()
    h["consumer"] += [_offer(NOW + 10, 150, 0), _ack(NOW + 10.1, 150)]
    h["accounting"].update(routed=4, finished=4, acknowledged=4)
    v = _check(h)
    assert not v.ok and v.counts["finished_twice"] == 1
    assert any("item 0 finished twice [100, 150]" in p for p in v.problems), v.problems


def test_the_checker_names_the_window_of_each_explained_duplicate():
    h = _history(4)
    # 0: not acked (the receiver skipped it), offered again after the timeout.
    h["consumer"] = [r for r in h["consumer"] if r.get("rid") != 100 and r.get("ids") != [100]]
    h["consumer"] += [_offer(NOW + 5, 100, 0), _offer(NOW + 8.5, 100, 0), _ack(NOW + 8.6, 100)]
    # 1: offered, the ledger restarted before an ack, offered again: recovered.
    h["consumer"] = [r for r in h["consumer"] if r.get("ids") != [101]]
    h["consumer"] += [_offer(NOW + 1.5, 101, 1), _ack(NOW + 1.6, 101)]
    # 2: acked during a full disk, then the ledger died before the ACK was written.
    h["consumer"].append(_offer(NOW + 30, 102, 2))
    h["faults"] = [{"kind": "enospc", "t0": NOW + 1.5, "t1": NOW + 4}]
    h["node_events"] = [(NOW + 1.2, "ledger", "ledger_serving", ""),
                        (NOW + 20, "ledger", "ledger_serving", "")]  # fmt: skip
    # 3: a second result, durable after its key was granted again.
    h["consumer"] += [_offer(NOW + 40, 160, 3), _ack(NOW + 40.1, 160)]
    h["node_events"].append(
        (NOW + 39, "ledger", "complete_superseded_after_durable", " key=c/000003 id=160")
    )
    # Its first lease was released during the group commit: counted released.
    h["accounting"].update(routed=5, finished=5, released=1, acknowledged=5, balanced=False)
    v = _check(h)
    assert v.ok, v.table()
    windows = {(d.item, d.window) for d in v.duplicates}
    assert windows == {
        (0, checker.W_OFFER_TIMEOUT),
        (1, checker.W_LEDGER_RESTART),
        (2, checker.W_ACK_NOT_DURABLE),
        (3, checker.W_SUPERSEDED),
    }, v.duplicates
    assert v.counts["recovered"] == 1
    assert checker.W_SUPERSEDED[:30] in v.table()


def test_the_checker_fails_on_an_unbalanced_or_undrained_ledger():
    h = _history()
    h["accounting"].update(balanced=False, routed=4)
    v = _check(h)
    assert any("not balanced" in p for p in v.problems)
    assert any("routed 4 (+0 superseded) != finished" in p for p in v.problems)
    h = _history()
    h["accounting"].update(in_flight=1, routed=4)
    assert any("not drained" in p for p in _check(h).problems)


def test_the_checker_fails_on_a_row_not_written_back():
    h = _history()
    h["table"]["c/000001"] = NOW - 60  # finished, yet due again: it would run twice
    v = _check(h)
    assert any("item 1 finished but its row is due again" in p for p in v.problems)


def test_maybe_written_items_are_decided_by_the_table():
    h = _history(2)
    h["producer"].append({"t": NOW, "ev": "write", "ids": [5, 6], "outcome": "maybe"})
    h["table"]["c/000005"] = NOW + CADENCE
    h["consumer"] += [_offer(NOW + 5, 105, 5), _ack(NOW + 5.1, 105)]
    h["accounting"].update(routed=3, finished=3, acknowledged=3)
    v = _check(h)
    assert v.ok, v.table()
    assert (v.counts["written"], v.counts["maybe_in_table"], v.counts["maybe_absent"]) == (3, 1, 1)


def test_the_node_log_is_read_for_evidence():
    text = (
        "2026-11-29 20:13:25,512 INFO ledger[123] action=ledger_serving address=x\n"
        "noise\n"
        "2026-11-29 20:13:26,001 WARNING ledger[123] action=writeback_failed key=c/000001\n"
    )
    events = checker.parse_node_log(text)
    assert [(role, action) for _, role, action, _ in events] == [
        ("ledger", "ledger_serving"), ("ledger", "writeback_failed")
    ]  # fmt: skip
    assert events[1][0] - events[0][0] == pytest.approx(0.489)
    assert "key=c/000001" in events[1][3]


def test_the_schedule_is_a_function_of_its_seed_and_covers_every_kind():
    assert schedule(7, 20) == schedule(7, 20)
    assert schedule(7, 20) != schedule(8, 20)
    for seed in range(20):
        actions = schedule(seed, len(KINDS))
        assert {a.kind for a in actions} == set(KINDS)
        at = [a.kind for a in actions].index("sigterm_restart")
        assert at < len(KINDS) // 2  # while the producer is still loading
        first = {a.kind: a for a in reversed(actions)}
        assert first["eio"].crash and not first["enospc"].crash  # both variants


# -- against a real node ---------------------------------------------------------------

SHORT = Settings(seed=20261129, items=300, actions=12, drain_s=60)


def _campaign(s: Settings, tmp_path) -> None:
    s.workdir = tmp_path / "campaign"
    out = run(s)
    print(report(s, out))
    assert out.verdict.ok, report(s, out)
    assert {f["kind"] for f in out.faults} >= set(KINDS)
    assert any(f["kind"] == "sigterm_restart" and f["loading"] for f in out.faults)


@pytest.mark.timeout(240)
def test_short_campaign_loses_nothing_and_explains_every_duplicate(tmp_path):
    _campaign(SHORT, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_long_campaign(tmp_path):
    _campaign(Settings(seed=7, items=2000, actions=36, drain_s=180), tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_long_campaign_on_a_real_small_filesystem(tmp_path):
    probe = tmp_path / "probe"
    why = mount_tmpfs(probe, "1m")
    if why:
        pytest.skip(f"cannot mount a tmpfs here: {why}")
    umount(probe)
    assert os.path.ismount(probe) is False
    _campaign(Settings(seed=11, items=1500, actions=24, tmpfs=True, drain_s=180), tmp_path)


# -- found by the campaign -------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_caller_that_dies_before_its_reply_leaves_no_traceback_in_the_ledger(tmp_path, node_name):
    """Found by the campaign: when an HTTP worker was killed with a request
    at the ledger, the ledger's reply met a closed connection and asyncio
    logged ``Task exception was never retrieved`` with a ConnectionResetError
    traceback. A caller that hangs up loses its reply, nothing else: the
    ledger goes on serving and logs no traceback."""
    import socket

    from node.ipc import IpcClient, pack
    from workers.claim import ledger_address

    node = NodeProcess(tmp_path / "data", node_name).start()
    try:
        address = ledger_address(node_name)
        ledger = IpcClient(address)
        polls0 = ledger.call("stats")["polls"]
        for i in range(5):  # long polls whose callers hang up at once
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(address)
                sock.sendall(pack({"op": "poll", "job": None, "max": 1, "wait_s": 0.3, "id": i}))
        wait_for(lambda: ledger.call("stats")["polls"] >= polls0 + 5, 20, "the 5 polls taken")
        # A poll that outlasts them: when it is answered, theirs were written.
        assert ledger.call("poll", job=None, max=1, wait_s=1.0, timeout_s=10)["results"] == []
        ledger.close()
        assert node.stop() == 0
        log = node.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]
    finally:
        finish([node], node_name)
