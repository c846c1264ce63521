"""The partition campaign's own rules (docs/reliability.md, "Partitions"):
the nemesis's schedule and the fleet checker's rules as plain functions
(seconds, in the default run), and one short campaign end to end
(``--run-slow``: a fleet of three in namespaces, a few minutes)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.campaign import checker
from tests.campaign.partition_checker import (
    W_MOVED,
    FleetEvidence,
    check_fleet,
    judge_cluster_poll,
    judge_cut,
    judge_faults,
    judge_skew,
)
from tests.campaign.partition_nemesis import KINDS, schedule

pytestmark = pytest.mark.timeout(60)

T = 1_800_000_000.0  # a fixed wall time for the evidence
TIMEOUT_S = 4.0
A, B = 1, 2  # node numbers
FAR = T + 30 * 86400  # a finished row's next due time


# -- the schedule ---------------------------------------------------------------------------


def test_a_schedule_is_a_function_of_its_seed():
    assert schedule(7, 12) == schedule(7, 12)
    assert schedule(7, 12) != schedule(8, 12)


@pytest.mark.parametrize("seed", range(20))
def test_a_long_schedule_has_every_kind_and_sane_targets(seed):
    actions = schedule(seed, 12, nodes=3, timeout_s=TIMEOUT_S)
    assert len(actions) == 12
    assert {a.kind for a in actions} == set(KINDS)
    for a in actions:
        assert 0 <= a.node < 3
        assert 1.0 <= a.pause_s <= 3.0
        if a.kind == "kill_in_change":
            assert a.other != a.node and 0 <= a.other < 3
            assert a.change in ("lapse", "join")
        elif a.kind == "one_way":
            assert a.other == -1 or (a.other != a.node and 0 <= a.other < 3)
            assert a.way in ("to", "from")
        else:
            assert a.other == -1
        if a.kind in ("cut_db", "lease_cut", "one_way"):
            # long enough to pass the deadline and lapse
            assert a.hold_s >= 1.6 * TIMEOUT_S - 0.01
        if a.kind == "blip_db":
            # short of the grant deadline (0.8 x the timeout)
            assert a.hold_s <= 0.5 * TIMEOUT_S + 0.01
        if a.kind == "skew":
            assert 2.0 <= abs(a.skew_s) <= 6.0
        else:
            assert a.skew_s == 0.0


def test_a_short_schedule_and_a_fleet_of_one():
    assert len(schedule(3, 2)) == 2
    with pytest.raises(ValueError):
        schedule(3, 5, nodes=1)


# -- the cluster's queue state ----------------------------------------------------------------


def _doc(rows: dict[str, int], due: dict[str, int], at: float = T, vouched: bool = True) -> dict:
    nodes = sorted(rows)
    return {
        "nodes": nodes,
        "now": {"rows": sum(rows.values()), "due": {"total": sum(due.values())}, "at": at},
        "trust": {"vouched": True, "nodes": {
            n: {"vouched": vouched, "rows": rows[n], "due": due[n]} for n in nodes}},
    }  # fmt: skip


def _judge(status: int, doc: Any, live: list[str] | None = None, rows: int = 100,
           history: list[tuple[float, int]] | None = None) -> str | None:  # fmt: skip
    live = ["a", "b"] if live is None else live
    return judge_cluster_poll(status, doc, live, live, rows, rows, history or [])


def test_a_503_without_counts_passes_and_with_counts_fails():
    doc = {"now": {"in_flight": None}, "trust": {"vouched": False}}
    assert _judge(503, doc) is None
    doc["now"]["due"] = {"total": 3}
    assert "with counts" in str(_judge(503, doc))
    assert "vouches" in str(_judge(503, {"now": {}, "trust": {"vouched": True}}))


def test_a_200_must_be_its_nodes_sum_over_the_live_list_within_the_table():
    ok = _doc({"a": 60, "b": 40}, {"a": 3, "b": 2})
    assert _judge(200, ok) is None
    partial = _doc({"a": 60, "b": 40}, {"a": 3, "b": 2})
    partial["now"]["rows"] = 60  # b left out of the sum
    assert "not its nodes'" in str(_judge(200, partial))
    assert "live list" in str(_judge(200, ok, live=["a", "b", "c"]))
    # The list changed while it was asked: no verdict on it from the list.
    assert judge_cluster_poll(200, ok, ["a", "b", "c"], ["a", "b"], 100, 100, []) is None
    assert "the table had 90" in str(_judge(200, ok, rows=90))
    # Rows are only added: a count far below the table's a while before it.
    assert "before" in str(_judge(200, ok, history=[(T - 20, 120), (T, 130)]))
    assert _judge(200, ok, history=[(T - 20, 80), (T, 130)]) is None
    assert "does not vouch" in str(_judge(200, _doc({"a": 60, "b": 40}, {"a": 3, "b": 2},
                                                    vouched=False)))  # fmt: skip
    assert "status 500" in str(_judge(500, {"error": "x"}))


# -- cuts and skews ---------------------------------------------------------------------------


def test_a_cut_node_refuses_before_it_lapses():
    good = {"refused_s": 3.1, "out_s": 3.9, "live_at_refusal": True, "granted_after_out": 0}
    assert judge_cut(good, TIMEOUT_S, lapsing=True) == []
    assert judge_cut({**good, "refused_s": None}, TIMEOUT_S, True) == [
        "no claim refused not_granting during the cut"]  # fmt: skip
    late = judge_cut({**good, "refused_s": 4.0, "out_s": 3.9, "live_at_refusal": False},
                     TIMEOUT_S, True)  # fmt: skip
    assert any("before it refused" in p for p in late)
    assert any("counted it out" in p for p in late)
    assert any("past the deadline" in p for p in judge_cut({**good, "refused_s": 5.0,
                                                            "out_s": 6.0}, TIMEOUT_S, True))
    assert judge_cut({**good, "granted_after_out": 2}, TIMEOUT_S, True)
    # A blip is short of the deadline: only grants after a lapse are judged.
    assert judge_cut({"refused_s": None, "out_s": None}, TIMEOUT_S, lapsing=False) == []


def test_a_skewed_clock_is_reported_and_flagged():
    assert judge_skew({"skew_s": 3.0, "reported_skew_s": {"skew_s": -2.98,
                                                          "flagged": True}}) == []  # fmt: skip
    assert judge_skew({"skew_s": 3.0, "reported_skew_s": None})
    assert judge_skew({"skew_s": 3.0, "reported_skew_s": {"skew_s": 3.0, "flagged": True}})
    assert judge_skew({"skew_s": 3.0, "reported_skew_s": {"skew_s": -3.0, "flagged": False}})


def test_every_fault_is_judged_by_its_kind():
    faults = [
        {"kind": "kill", "target": "n0"},
        {"kind": "cut_db", "target": "n1", "refused_s": None, "out_s": 4.0},
        {"kind": "blip_db", "target": "n1", "refused_s": None, "out_s": None},
        {"kind": "skew", "target": "n2", "skew_s": 2.5, "reported_skew_s": None},
        {"kind": "cut_peers", "target": "n0", "all_live": False},
        {"kind": "kill_in_change", "target": "n0", "error": "AssertionError('x')"},
    ]
    problems = judge_faults(faults, TIMEOUT_S)
    assert len(problems) == 4, problems
    assert [p.split(" ")[0] for p in problems] == ["cut_db", "skew", "cut_peers",
                                                   "kill_in_change"]  # fmt: skip


# -- the items ----------------------------------------------------------------------------------


def _books(finished: int) -> dict[str, Any]:
    return {"balanced": True, "gaps": {"input": 0}, "routed": finished, "finished": finished,
            "expired": 0, "released": 0, "in_flight": 0, "awaiting_ack": 0}  # fmt: skip


def _evidence(**over: Any) -> FleetEvidence:
    """Items 1 (made by node A) and 2 (by B), written, offered, acked."""
    rid1, rid2 = (A << 45) + 1, (B << 45) + 1
    ev = FleetEvidence(
        producer=[{"t": T, "ev": "write", "ids": [1, 2], "outcome": "ok"},
                  {"t": T, "ev": "write", "ids": [3], "outcome": "maybe"}],
        consumer=[
            {"t": T + 1, "ev": "claim", "key": "c/000001"},
            {"t": T + 2, "ev": "offer", "rid": rid1, "key": "c/000001", "result": {"id": 1}},
            {"t": T + 2, "ev": "offer", "rid": rid2, "key": "c/000002", "result": {"id": 2}},
            {"t": T + 3, "ev": "ack", "ids": [rid1, rid2]},
        ],
        runs=[],
        table={"c/000001": FAR, "c/000002": FAR},
        accounting={"a": _books(1), "b": _books(1)},
        cluster_accounting={**_books(2), "by_node": {}},
        input_gaps={"a": 0, "b": 0},
        numbers={A: "a", B: "b"},
        node_events={"a": [], "b": []},
        faults=[],
        live_changes=[(T - 100, ["a", "b"])],
        offer_timeout_s=3,
        lease_s_max=10,
        ended_at=T + 10,
    )  # fmt: skip
    for k, v in over.items():
        setattr(ev, k, v)
    return ev


def test_a_clean_fleet_passes_and_a_maybe_written_item_may_be_absent():
    verdict = check_fleet(_evidence())
    assert verdict.ok, verdict.problems
    assert verdict.counts["written"] == 2 and verdict.counts["maybe_absent"] == 1


def test_a_lost_item_and_a_node_off_its_input_law_fail():
    ev = _evidence()
    ev.consumer = [r for r in ev.consumer if r.get("rid") != (B << 45) + 1]
    ev.consumer[-1] = {"t": T + 3, "ev": "ack", "ids": [(A << 45) + 1]}
    ev.accounting["b"] = _books(0)
    verdict = check_fleet(ev)
    assert verdict.counts["lost"] == 1
    assert any("lost: item 2" in p for p in verdict.problems)
    ev = _evidence(input_gaps={"a": 0, "b": -4})
    ev.accounting["b"] = {**_books(1), "balanced": False, "gaps": {"input": -4}}
    problems = check_fleet(ev).problems
    assert any(p.startswith("b: the input law is off: gap -4") for p in problems), problems
    assert any("b: counters.input_gap -4" in p for p in problems)


def test_a_node_whose_finished_count_is_not_its_results_fails():
    ev = _evidence()
    ev.accounting["a"] = _books(2)
    assert any("a: /accounting finished 2 but 1" in p for p in check_fleet(ev).problems)


def _finished_twice(live_changes: list) -> FleetEvidence:
    ev = _evidence(live_changes=live_changes)
    rid3 = (B << 45) + 2  # item 1 finished again, by B
    ev.consumer.insert(3, {"t": T + 4, "ev": "offer", "rid": rid3, "key": "c/000001",
                           "result": {"id": 1}})  # fmt: skip
    ev.consumer.append({"t": T + 5, "ev": "ack", "ids": [rid3]})
    ev.accounting["b"] = _books(2)
    ev.cluster_accounting = {**_books(3), "by_node": {}}
    return ev


def test_two_nodes_one_key_is_explained_only_by_a_change_of_the_live_list():
    moved = check_fleet(_finished_twice([(T - 100, ["a", "b"]), (T + 1.5, ["b"])]))
    assert moved.ok, moved.problems
    assert [d.window for d in moved.duplicates] == [W_MOVED]
    still = check_fleet(_finished_twice([(T - 100, ["a", "b"])]))
    assert not still.ok
    assert any("unexplained duplicate: item 1 finished twice" in p for p in still.problems)


def test_a_redelivery_is_explained_by_its_own_nodes_ledger_restart_only():
    rid = (A << 45) + 1

    def again(events: dict[str, list]) -> checker.Verdict:
        ev = _evidence(node_events=events)
        ev.consumer.insert(2, {"t": T + 2.5, "ev": "offer", "rid": rid, "key": "c/000001",
                               "result": {"id": 1}})  # fmt: skip
        return check_fleet(ev)

    start = (T + 2.2, "ledger", "ledger_serving", "")
    own = again({"a": [start], "b": []})
    assert own.ok, own.problems
    assert [d.window for d in own.duplicates] == [checker.W_LEDGER_RESTART]
    other = again({"a": [], "b": [start]})
    assert not other.ok
    assert any("unexplained duplicate" in p for p in other.problems)


# -- one short campaign ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_short_partition_campaign_passes(tmp_path):
    from tests.campaign.partition_run import Settings, report, run
    from tests.netns import Net, NetUnavailable

    try:
        Net(os.environ.get("QUEUE_NODE_TEST_PG", "postgresql://postgres@127.0.0.1:5432")).close()
    except NetUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"network namespaces cannot be made: {exc}")
        pytest.skip(f"network namespaces cannot be made: {exc}")
    s = Settings(seed=11, actions=4, items=200, workdir=tmp_path / "campaign")
    out = run(s)
    print(report(s, out))
    assert out.verdict.ok, report(s, out)


def test_an_offer_timeout_runs_from_the_poll_that_brought_the_offer():
    """A cluster poll answered late (a fan-out through a slow peer): its
    offer was made when the poll was sent, so the offer timeout is measured
    from there, not from the answer's arrival (the short campaign once
    judged a re-offer 2.1 s after a 3 s answer unexplained)."""
    rid = (A << 45) + 1

    def again(sent: float | None) -> checker.Verdict:
        ev = _evidence()
        first = ev.consumer[1]
        if sent is not None:
            first["sent"] = sent
        ev.consumer.insert(2, {"t": T + 4.1, "ev": "offer", "rid": rid, "key": "c/000001",
                               "result": {"id": 1}})  # fmt: skip
        ev.consumer[-1]["t"] = T + 5  # acked after both
        return check_fleet(ev)

    late = again(T - 0.5)  # sent 2.5 s before the answer came
    assert late.ok, late.problems
    assert [d.window for d in late.duplicates] == [checker.W_OFFER_TIMEOUT]
    assert not again(None).ok  # 2.1 s after the answer, with no send time: early
    assert not again(T + 1.9).ok  # 2.2 s after the send: early still
