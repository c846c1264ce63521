"""The rules of ``?scope=cluster`` (node/fleet/cluster.py): what may be
summed, and how each group adds up."""

from __future__ import annotations

import pytest

from node.fleet.cluster import (
    Answer,
    Down,
    NotSummable,
    Peer,
    judge,
    not_summed,
    sum_accounting,
    sum_queue_states,
)

pytestmark = pytest.mark.timeout(10)

LIVE = ["a", "b"]


def _class(route: str, due: int, rows: int, minute: int, ratio: float) -> dict:
    return {"route": route, "cadence_s": 3600, "source": "route", "sitemap": False,
            "boost": 0.0, "rows": rows, "due": due, "oldest_due_minute": minute,
            "oldest_lateness_ratio": ratio}  # fmt: skip


def _doc(name: str, due: int, at: float, classes: list[dict], minute: int) -> dict:
    return {
        "now": {"due": {"sitemap": 0, "discovered": due, "total": due}, "rows": due + 1,
                "classes": len(classes), "at": at, "in_flight": 1, "held": 0, "parked": 0,
                "unclaimed": due - 1, "paused": {"node": name == "a", "routes": [name]},
                "paused_nodes": ["a"], "status": "live"},  # fmt: skip
        "coming": {"15m": 1, "60m": 1, "24h": 1, "by_hour": [1] + [0] * 23},
        "lateness": {
            "edges": [0.0], "labels": ["<0.25"], "sitemap": [0] * 6,
            "discovered": [due, 0, 0, 0, 0, 0], "total": [due, 0, 0, 0, 0, 0],
            "by_route": {c["route"]: [c["due"], 0, 0, 0, 0, 0] for c in classes},
            "by_route_truncated": False,
            "oldest": [{**c, "lateness_s": 60.0, "lateness_ratio": c["oldest_lateness_ratio"]}
                       for c in classes],  # fmt: skip
            "oldest_truncated": False,
        },
        "flow": {"minutes": [{"minute": minute, "came_due": due, "added": 0}],
                 "last_hour": {"came_due": due, "added": 0}},  # fmt: skip
        "classes": {"rows": classes, "truncated": False},
        "counters": {"received": due, "withdrawn": 0, "waiting": due - 1, "at": at},
        "trust": {"vouched": True, "reason": None, "status": "live", "counts_at": at,
                  "membership": {"name": name, "number": 1 + LIVE.index(name), "live": LIVE}},
    }  # fmt: skip


def _answers(*docs: dict, status: int = 200) -> list[Answer]:
    pairs = enumerate(zip(LIVE, docs, strict=False))
    return [Answer(Peer(n, f"h:{i}"), status, d) for i, (n, d) in pairs]


def test_every_group_adds_up_and_classes_merge_by_identity():
    a = _doc("a", 3, 100.0, [_class("pages", 2, 2, 50, 0.1), _class("docs", 1, 1, 40, 0.3)], 7)
    b = _doc("b", 4, 104.0, [_class("pages", 4, 5, 45, 0.2)], 8)
    doc = sum_queue_states(judge(_answers(a, b)), {"a": "h:0", "b": "h:1"})
    now = doc["now"]
    assert doc["scope"] == "cluster" and doc["nodes"] == ["a", "b"]
    assert now["due"] == {"sitemap": 0, "discovered": 7, "total": 7}
    assert (now["at"], now["at_newest"]) == (100.0, 104.0)
    assert (now["in_flight"], now["unclaimed"], now["rows"]) == (2, 5, 9)
    assert now["classes"] == 2  # pages and docs, pages on both nodes
    assert now["paused"] == {"node": False, "routes": ["a", "b"]}
    assert now["paused_nodes"] == ["a"]
    pages = next(c for c in doc["classes"]["rows"] if c["route"] == "pages")
    assert (pages["due"], pages["rows"], pages["oldest_due_minute"]) == (6, 7, 45)
    assert pages["oldest_lateness_ratio"] == 0.2
    assert [c["route"] for c in doc["classes"]["rows"]] == ["pages", "docs"]  # most due first
    assert doc["lateness"]["total"][0] == 7
    assert doc["lateness"]["by_route"] == {"pages": [6, 0, 0, 0, 0, 0], "docs": [1, 0, 0, 0, 0, 0]}
    assert [e["route"] for e in doc["lateness"]["oldest"]] == ["docs", "pages"]  # most late first
    assert doc["coming"]["by_hour"][0] == 2 and doc["coming"]["60m"] == 2
    assert [m["minute"] for m in doc["flow"]["minutes"]] == [7, 8]
    assert doc["flow"]["last_hour"]["came_due"] == 7
    assert doc["counters"]["received"] == 7 and doc["counters"]["at"] == 100.0
    assert doc["trust"]["nodes"]["b"]["address"] == "h:1"
    assert doc["trust"]["down"] == []


@pytest.mark.parametrize(
    "spoil, why",
    [
        (lambda d: d["trust"].update(vouched=False, reason="loading"), "does not vouch: loading"),
        (lambda d: d["trust"]["membership"].update(name="z"), "answers as node 'z'"),
        (lambda d: d["trust"]["membership"].update(live=["b"]), "membership is changing"),
    ],
)
def test_an_answer_that_may_not_be_summed_is_named_and_nothing_is_summed(spoil, why):
    b = _doc("b", 1, 1.0, [], 1)
    spoil(b)
    with pytest.raises(NotSummable) as caught:
        judge(_answers(_doc("a", 1, 1.0, [], 1), b))
    assert caught.value.missing == ["b"]
    assert caught.value.reason.startswith("node b at h:1: ") and why in caught.value.reason


def test_a_peer_that_did_not_answer_is_missing_and_the_503_has_no_counts():
    late = Answer(Peer("b", "h:1"), error="no answer in 2 s")
    with pytest.raises(NotSummable) as caught:
        judge([_answers(_doc("a", 1, 1.0, [], 1))[0], late])
    doc = not_summed(caught.value.reason, caught.value.missing, [Peer("a", "h:0"), late.peer])
    assert doc["trust"]["vouched"] is False and doc["trust"]["missing"] == ["b"]
    assert "no answer in 2 s" in doc["trust"]["reason"]
    assert "due" not in doc["now"] and doc["trust"]["nodes"]["a"]["summed"] is True


def test_the_ledgers_add_up_and_balance_only_when_every_node_does():
    one = {"received": 5, "waiting": 2, "routed": 3, "balanced": True, "since": 9.0,
           "gaps": {"input": 0, "output": 0}}  # fmt: skip
    two = {"received": 4, "waiting": 1, "routed": 2, "balanced": False, "since": 3.0,
           "gaps": {"input": 1, "output": 0}}  # fmt: skip
    books = sum_accounting({"a": one, "b": two})
    assert (books["received"], books["waiting"], books["routed"]) == (9, 3, 5)
    assert books["balanced"] is False and books["by_node"]["b"]["balanced"] is False
    assert books["gaps"]["input"] == 1 and books["since"] == 3.0
    with pytest.raises(NotSummable):
        judge(_answers(one, {"error": {"code": "ledger_unavailable"}}, status=200)[:1]
              + [Answer(Peer("b", "h:1"), 503, {"error": {"code": "ledger_unavailable"}})],
              queue_state=False)  # fmt: skip


def test_a_503_shows_each_answering_node_by_itself_and_sums_nothing():
    a = _doc("a", 3, 100.0, [_class("pages", 3, 3, 50, 0.1)], 7)
    late = Answer(Peer("b", "h:1"), error="no answer in 2 s")
    answers = [_answers(a)[0], late]
    with pytest.raises(NotSummable) as caught:
        judge(answers)
    doc = not_summed(caught.value.reason, caught.value.missing, [p.peer for p in answers], answers)
    assert set(doc["now"]) == {"in_flight", "paused", "status"}  # no summed counts
    assert all(key not in doc for key in ("lateness", "coming", "classes", "counters"))
    shown, missing = doc["trust"]["nodes"]["a"], doc["trust"]["nodes"]["b"]
    # a's own figures, the same as a 200 gives it, marked its own (not summed).
    summed = sum_queue_states({"a": a}, {"a": "h:0"})["trust"]["nodes"]["a"]
    assert {k: shown[k] for k in summed} == summed
    assert (shown["due"], shown["in_flight"], shown["lateness"]) == (3, 1, [3, 0, 0, 0, 0, 0])
    assert shown["own_figures"] is True and shown["summed"] is True
    # b gave nothing: no figures, its error as its reason.
    assert missing["own_figures"] is False and missing["summed"] is False
    assert missing["due"] is None and missing["vouched"] is False
    assert missing["reason"] == "no answer in 2 s" and missing["address"] == "h:1"
    assert doc["trust"]["down"] is None  # the list's other nodes were not given


def test_a_node_that_does_not_vouch_shows_its_verdict_and_no_counts():
    b = {"now": {"in_flight": 2, "paused": {"node": False, "routes": []}, "status": "loading"},
         "trust": {"vouched": False, "reason": "loading", "status": "loading",
                   "membership": {"name": "b", "number": 2, "live": LIVE}}}  # fmt: skip
    answers = _answers(_doc("a", 1, 1.0, [], 1), b)
    with pytest.raises(NotSummable) as caught:
        judge(answers)
    doc = not_summed(caught.value.reason, caught.value.missing, [p.peer for p in answers], answers)
    node = doc["trust"]["nodes"]["b"]
    assert (node["vouched"], node["reason"], node["own_figures"]) == (False, "loading", True)
    assert (node["due"], node["in_flight"], node["number"]) == (None, 2, 2)


def test_the_nodes_down_are_named_on_a_200_and_a_503():
    down = [Down("c", "h:2", 3, 12.345, left=False), Down("d", "h:3", 4, 0.04, left=True)]
    named = [{"name": "c", "address": "h:2", "number": 3, "heartbeat_age_s": 12.3,
              "state": "lapsed"},
             {"name": "d", "address": "h:3", "number": 4, "heartbeat_age_s": 0.0,
              "state": "left"}]  # fmt: skip
    a = _doc("a", 1, 1.0, [], 1)
    assert sum_queue_states({"a": a}, {"a": "h:0"}, down)["trust"]["down"] == named
    doc = not_summed("node b at h:1: no answer", ["b"], [Peer("a", "h:0"), Peer("b", "h:1")],
                     down=down)  # fmt: skip
    assert doc["trust"]["down"] == named


def test_a_503_of_the_ledgers_carries_each_answering_nodes_books():
    one = {"received": 5, "balanced": True, "gaps": {"input": 0, "output": 0}}
    refused = {"error": {"code": "ledger_unavailable"}}
    answers = [Answer(Peer("a", "h:0"), 200, one), Answer(Peer("b", "h:1"), 503, refused)]
    with pytest.raises(NotSummable) as caught:
        judge(answers, queue_state=False)
    doc = not_summed(caught.value.reason, caught.value.missing, [p.peer for p in answers],
                     answers, queue_state=False)  # fmt: skip
    assert doc["by_node"] == {"a": {"balanced": True, "gaps": {"input": 0, "output": 0}}}
    assert "received" not in doc and "balanced" not in doc  # no sum
    assert doc["trust"]["nodes"] == {"a": {"address": "h:0", "summed": True},
                                     "b": {"address": "h:1", "summed": False}}  # fmt: skip
