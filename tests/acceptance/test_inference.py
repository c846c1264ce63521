"""Inference processes: handlers, batches, failures, timeouts, GPUs.

Two tiers. Unit: ``workers.inference.Inference`` driven one batch at a time
against an in-memory claimer (no processes, no clock: the watchdog is called
with the time it should see). Acceptance: ``python -m node run`` with a test
handler from ``tests/handlers.py``, real signals and a real ``kill -9``.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from node.client import ClientError
from node.config import Config, RouteConfig
from node.handlers import (
    CPU_WORK_ROUNDS_ENV,
    Handler,
    HandlerError,
    check_spec,
    cpu_digest,
    cpu_work_rounds,
    load,
)
from node.testing import NodeProcess, finish, wait_for
from tests.handlers import read_records
from workers.inference import process as inference
from workers.inference.process import (
    DRAIN_ERROR,
    NOT_RUN_ERROR,
    Handlers,
    Inference,
    Settings,
    default_handler_timeout_s,
)

pytestmark = pytest.mark.timeout(120)


# -- handlers --------------------------------------------------------------------------


def test_load_names_the_missing_module_or_attribute() -> None:
    with pytest.raises(HandlerError, match="cannot import module 'no_such_mod'"):
        load("no_such_mod:f")
    with pytest.raises(HandlerError, match="module 'node.handlers' has no attribute 'nope'"):
        load("node.handlers:nope")
    with pytest.raises(HandlerError, match="expected MODULE:CALLABLE"):
        load("node.handlers")
    with pytest.raises(HandlerError, match="not a callable"):
        load("node.handlers:CPU_WORK_DEFAULT_ROUNDS")
    with pytest.raises(HandlerError, match="no module named 'no_such_mod'"):
        check_spec("no_such_mod:f")
    check_spec("tests.handlers:Recorder")


def test_class_handler_is_set_up_once_with_its_device() -> None:
    handler = Handler.load("node.handlers:cpu_work")
    handler.setup("cuda:0")
    handler.setup("cpu")  # once per process: a second call changes nothing
    assert handler.device == "cuda:0"
    out = handler([{"key": "a", "payload": {"n": 1}, "job": "j", "lease_id": 1}])
    assert out == [{"digest": cpu_digest("a", {"n": 1}, cpu_work_rounds()), "rounds": 2500}]


def test_function_handler_and_wrong_result_count() -> None:
    handler = Handler.load("tests.handlers:wrong_count")
    handler.setup("cpu")
    with pytest.raises(Exception, match="returned 1 results for 2 items"):
        handler([{"key": "a"}, {"key": "b"}])


def test_cpu_work_rounds_from_the_environment() -> None:
    assert cpu_work_rounds({CPU_WORK_ROUNDS_ENV: "10"}) == 10
    with pytest.raises(HandlerError, match=CPU_WORK_ROUNDS_ENV):
        cpu_work_rounds({CPU_WORK_ROUNDS_ENV: "many"})


# -- one process, one batch at a time, against an in-memory claimer -------------------


class MemoryClaimer:
    """LocalClaimer's methods over plain lists; refusals as ``ClientError``."""

    def __init__(self, grants: list[Any]) -> None:
        self.grants = list(grants)
        self.completed: dict[str, Any] = {}
        self.released: dict[str, str | None] = {}
        self.renewed: list[str] = []
        self.complete_errors: list[ClientError] = []

    def claim(self, max: int, lease_s: float, consumer: str, wait_s: float = 0.0) -> list[Any]:
        taken, self.grants = self.grants[:max], self.grants[max:]
        return taken

    def complete_many(self, items: list[tuple[int, str, Any]]) -> list[Any]:
        if self.complete_errors:
            error = self.complete_errors.pop(0)
            if error.status >= 500:
                raise error  # the ledger could not be reached: nothing taken
            # Refused for the first item only.
            return [error] + self.complete_many(items[1:])
        out: list[Any] = []
        for _lease_id, key, result in items:
            self.completed[key] = result
            out.append(len(self.completed))
        return out

    def release(self, lease_id: int, key: str, error: str | None = None) -> None:
        self.released[key] = error

    def renew(self, lease_id: int, key: str, lease_s: float) -> float:
        self.renewed.append(key)
        return time.time() + lease_s


_lease_ids = itertools.count(1)


def _grants(keys: list[str], route: str = "r", misses: int = 0) -> list[Any]:
    """Leases as a claim answers them, with the route and the misses before."""
    return [
        {
            "lease_id": next(_lease_ids),
            "key": k,
            "payload": {"k": k},
            "job": "j",
            "route": route,
            "misses": misses,
        }
        for k in keys
    ]


def _settings(**kw: Any) -> Settings:
    base = dict(
        index=0,
        gpu=None,
        consumer="inference-0@test",
        batch_size=16,
        lease_s=3.0,
        handler_timeout_s=2.0,
        drain_timeout_s=30.0,
    )
    base.update(kw)
    return Settings(**base)


def _inference(handler: Any, grants: list[Any], routes: dict | None = None, **kw: Any):
    fns = {"tests.unit:a": handler, **kw.pop("extra", {})}
    config = Config(handler="tests.unit:a", routes=routes or {})
    handlers = Handlers(config, load=lambda spec: Handler(spec, fns[spec]))
    handlers.setup("cpu")
    claimer = MemoryClaimer(grants)
    exits: list[int] = []
    inf = Inference(_settings(**kw), handlers, claimer, exit_process=exits.append)
    return inf, claimer, exits


@pytest.fixture(autouse=True)
def _no_stop():
    inference._stop["at"] = None
    yield
    inference._stop["at"] = None


def test_per_item_exception_releases_only_that_item() -> None:
    def handler(items):
        return [ValueError("bad") if i["key"] == "b" else {"ok": i["key"]} for i in items]

    inf, claimer, _ = _inference(handler, _grants(["a", "b", "c"]))
    assert inf.step() == 3
    assert claimer.completed == {"a": {"ok": "a"}, "c": {"ok": "c"}}
    assert claimer.released == {"b": "ValueError: bad"}
    assert inf.stats.failed == 1 and inf.stats.completed == 2


def test_raising_handler_releases_the_batch_and_suspects_then_run_alone() -> None:
    calls: list[list[str]] = []

    def handler(items):
        keys = [i["key"] for i in items]
        calls.append(keys)
        if "p" in keys:
            raise RuntimeError("boom")
        return [{"ok": k} for k in keys]

    inf, claimer, _ = _inference(handler, _grants(["a", "p", "c"]))
    inf.step()
    assert claimer.released == {k: "RuntimeError: boom" for k in ("a", "p", "c")}
    # The same keys come back (after their hold): each runs in a call of its own.
    claimer.grants = _grants(["a", "p", "c", "d", "e"])
    claimer.released.clear()
    inf.step()
    assert calls[1:] == [["d", "e"], ["a"], ["p"], ["c"]]
    assert claimer.released == {"p": "RuntimeError: boom"}
    assert set(claimer.completed) == {"a", "c", "d", "e"}


def test_an_item_that_missed_before_runs_alone() -> None:
    calls: list[list[str]] = []

    def handler(items):
        calls.append([i["key"] for i in items])
        return [{} for _ in items]

    inf, _, _ = _inference(handler, _grants(["a", "b"]) + _grants(["m"], misses=1))
    inf.step()
    assert calls == [["a", "b"], ["m"]]


def test_items_of_different_handlers_never_share_a_call() -> None:
    seen: dict[str, list[list[str]]] = {"a": [], "b": []}

    def handler_a(items):
        seen["a"].append([i["key"] for i in items])
        return [{} for _ in items]

    def handler_b(items):
        seen["b"].append([i["key"] for i in items])
        return [{} for _ in items]

    grants = _grants(["a1", "a2"], route="ra") + _grants(["b1"], route="rb")
    grants.insert(1, _grants(["b2"], route="rb")[0])
    inf, claimer, _ = _inference(
        handler_a,
        grants,
        routes={"rb": RouteConfig(handler="tests.unit:b")},
        extra={"tests.unit:b": handler_b},
    )
    inf.step()
    assert seen == {"a": [["a1", "a2"]], "b": [["b2", "b1"]]}
    assert len(claimer.completed) == 4


def test_bad_results_fail_their_item_or_the_batch() -> None:
    inf, claimer, _ = _inference(lambda items: [object() for _ in items], _grants(["a"]))
    inf.step()
    assert claimer.released["a"].startswith("bad result: TypeError")
    inf, claimer, _ = _inference(lambda items: [], _grants(["a", "b"]))
    inf.step()
    assert claimer.released == {
        "a": "HandlerResultError: handler returned 0 results for 2 items",
        "b": "HandlerResultError: handler returned 0 results for 2 items",
    }


def test_bytes_and_json_results_are_completed_as_given() -> None:
    inf, claimer, _ = _inference(lambda items: [b"\x00raw", [1, "x"]], _grants(["a", "b"]))
    inf.step()
    assert claimer.completed == {"a": b"\x00raw", "b": [1, "x"]}


def test_watchdog_renews_open_leases_every_third_of_a_lease() -> None:
    def handler(items):
        batch = inf.batch
        now = time.monotonic()
        inf.watch_once(batch, now)  # not due yet
        assert claimer.renewed == []
        inf.watch_once(batch, now + inf.settings.renew_every_s + 0.01)
        return [{} for _ in items]

    inf, claimer, exits = _inference(handler, _grants(["a", "b"]), handler_timeout_s=60.0)
    inf.step()
    assert sorted(claimer.renewed) == ["a", "b"]
    assert exits == []


def test_handler_timeout_releases_with_the_error_and_exits() -> None:
    def handler(items):
        # The watchdog, as it would run 2 s into this call.
        inf.watch_once(inf.batch, time.monotonic() + 2.0)
        return [{} for _ in items]

    grants = _grants(["a", "b"], route="ra") + _grants(["c"], route="rb")
    inf, claimer, exits = _inference(
        handler,
        grants,
        routes={"rb": RouteConfig(handler="tests.unit:b")},
        extra={"tests.unit:b": lambda items: [{} for _ in items]},
    )
    inf.step()
    assert exits == [1]
    # The call that hung, and the group that never ran.
    assert claimer.released == {
        "a": "handler timeout after 2s",
        "b": "handler timeout after 2s",
        "c": NOT_RUN_ERROR,
    }
    assert claimer.completed == {}


def test_drain_deadline_releases_a_batch_still_running_and_exits_0() -> None:
    def handler(items):
        inference._stop["at"] = time.monotonic() - 100.0  # SIGTERM long ago
        inf.watch_once(inf.batch, time.monotonic())
        return [{} for _ in items]

    inf, claimer, exits = _inference(handler, _grants(["a"]), handler_timeout_s=600.0)
    inf.step()
    assert exits == [0]
    assert claimer.released == {"a": DRAIN_ERROR}


def test_results_are_retried_while_the_ledger_cannot_take_them() -> None:
    inf, claimer, _ = _inference(lambda items: [{} for _ in items], _grants(["a", "b"]))
    claimer.complete_errors = [ClientError(503, "ledger_unavailable", "restarting")]
    inf.step()
    assert set(claimer.completed) == {"a", "b"} and claimer.released == {}


def test_a_result_for_a_lease_granted_on_is_counted_lost() -> None:
    inf, claimer, _ = _inference(lambda items: [{} for _ in items], _grants(["a", "b"]))
    claimer.complete_errors = [ClientError(409, "lease_conflict", "granted since")]
    inf.step()
    assert set(claimer.completed) == {"b"}
    assert inf.stats.lost == 1 and claimer.released == {}


def test_default_handler_timeout() -> None:
    assert default_handler_timeout_s(1.0) == 60.0
    assert default_handler_timeout_s(60.0) == 600.0


# -- acceptance: the node with real inference processes -------------------------------


@pytest.fixture
def start_node(tmp_path: Path, node_name: str):
    started: list[NodeProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, rows: int = 0) -> NodeProcess:
        record = tmp_path / "records"
        record.mkdir(exist_ok=True)
        env = {"QN_TEST_RECORD_DIR": str(record), **(env or {})}
        node = NodeProcess(tmp_path / "data", node_name, *args, env=env)
        started.append(node)
        node.start()
        if rows:
            seed(node, rows)
        return node

    yield start
    finish(started, node_name)


def keys_of(n: int) -> list[str]:
    return [f"item-{i:04d}" for i in range(n)]


def seed(node: NodeProcess, n: int, route: str = "r", prefix: str = "item") -> None:
    due = time.time() - 120  # due in a past minute
    rows = [
        {
            "key": f"{prefix}-{i:04d}",
            "route": route,
            "cadence_s": 86400,
            "due_at": due,
            "payload": {"i": i},
            "job": "t",
        }
        for i in range(n)
    ]
    status, body = node.request("POST", "/rows", rows)
    assert status == 200, body


def accounting(node: NodeProcess) -> dict[str, Any]:
    status, body = node.request("GET", "/accounting")
    assert status == 200, body
    return body


def held(node: NodeProcess) -> dict[str, dict[str, Any]]:
    status, body = node.request("GET", "/held?limit=1000")
    assert status == 200, body
    return {h["key"]: h for h in body["held"]}


def finished(node: NodeProcess, n: int) -> Any:
    doc = accounting(node)
    return doc if doc["finished"] >= n else False


def collect_results(node: NodeProcess, want: set[str], timeout_s: float) -> dict[str, Any]:
    """Poll and ack results until every key in ``want`` has one."""
    got: dict[str, Any] = {}

    def more() -> bool:
        status, body = node.request("GET", "/results?max=1000")
        if status == 503:  # the ledger is busy or restarting: the contract says retry
            return False
        assert status == 200, (status, body)
        by_job: dict[str, list[int]] = {}
        for r in body["results"]:
            got[r["key"]] = r["result"]
            by_job.setdefault(r["job"], []).append(r["id"])
        for job, ids in by_job.items():
            status, answer = node.request("POST", f"/jobs/{job}/ack", {"ids": ids})
            assert status == 200, answer
        return want <= set(got)

    wait_for(more, timeout_s, f"results of {len(want)} keys")
    return got


def test_gpus_start_one_process_per_card_set_up_as_cuda_0(start_node, tmp_path) -> None:
    node = start_node("--handler", "tests.handlers:Recorder", "--gpus", "0,1")
    records = tmp_path / "records"

    def both_set_up():
        setups = read_records(records, "setup")
        cards = {s["cuda_visible_devices"] for s in setups}
        return setups if cards >= {"0", "1"} else False

    setups = wait_for(both_set_up, 20, "setup() in both inference processes")
    assert {s["device"] for s in setups} == {"cuda:0"}
    pids = node.pids()["inference"]
    assert len(pids) == 2
    by_card = {s["cuda_visible_devices"]: s["pid"] for s in setups if s["pid"] in pids}
    assert sorted(by_card) == ["0", "1"], setups
    for card, pid in by_card.items():
        assert "--gpu" in psutil.Process(pid).cmdline()
        assert psutil.Process(pid).cmdline()[-1] == card
    # And they work: items go through them to finished.
    seed(node, 20)
    wait_for(lambda: finished(node, 20), 20, "20 finished")


@pytest.mark.parametrize("handler", ["poison_item", "poison_batch"])
def test_poison_key_is_held_then_parked_while_the_rest_finish(start_node, handler) -> None:
    n = 40
    poison = "item-0003"
    node = start_node(
        "--handler",
        f"tests.handlers:{handler}",
        "--inference-procs",
        "2",
        "--lease-s",
        "1",
        env={"QUEUE_NODE_MAX_MISSES": "3", "QN_TEST_POISON_KEY": poison},
        rows=n,
    )
    misses_seen: set[int] = set()

    def parked():
        hold = held(node).get(poison)
        if hold is not None:
            misses_seen.add(hold["misses"])
            assert "poison" in (hold["last_error"] or ""), hold
        return hold if hold is not None and hold["parked"] else False

    hold = wait_for(parked, 40, f"{poison} parked")
    assert hold["misses"] == 3
    assert misses_seen <= {1, 2, 3} and 3 in misses_seen
    results = collect_results(node, set(keys_of(n)) - {poison}, 30)
    assert poison not in results
    others = {k: h for k, h in held(node).items() if k != poison}
    assert others == {}, f"keys other than the poison key are held or parked: {others}"
    doc = wait_for(lambda: finished(node, n - 1), 10, "the rest finished")
    assert doc["finished"] == n - 1
    if handler == "poison_item":
        assert doc["released"] == 3  # the poison key alone, once per miss
    assert doc["balanced"], doc


def test_kill_9_mid_batch_expires_the_leases_and_the_items_are_done_later(
    start_node, tmp_path
) -> None:
    n = 30
    block = tmp_path / "block"
    block.write_text("")
    node = start_node(
        "--handler",
        "tests.handlers:blocker",
        "--inference-procs",
        "2",
        "--lease-s",
        "1",
        env={"QN_TEST_BLOCK_FILE": str(block)},
        rows=n,
    )
    records = tmp_path / "records"
    blocked = wait_for(lambda: read_records(records, "blocked"), 20, "a blocked batch")[0]
    assert blocked["pid"] in node.pids()["inference"]
    os.kill(blocked["pid"], signal.SIGKILL)
    wait_for(
        lambda: blocked["pid"] not in node.pids()["inference"] and all(node.pids()["inference"]),
        20,
        "the inference process restarted",
    )
    results = collect_results(node, set(keys_of(n)), 40)
    assert set(blocked["keys"]) <= set(results)
    doc = accounting(node)
    assert doc["expired"] >= len(blocked["keys"]), doc
    assert doc["finished"] == n and doc["balanced"], doc


def test_handler_timeout_releases_the_batch_and_restarts_the_process(start_node, tmp_path) -> None:
    from node.config import OPTIONS

    assert "handler_timeout_s" in OPTIONS, "node/config.py has no handler_timeout_s option yet"
    n = 30
    block = tmp_path / "block"
    block.write_text("")
    node = start_node(
        "--handler",
        "tests.handlers:blocker",
        "--inference-procs",
        "2",
        "--lease-s",
        "2",
        env={"QN_TEST_BLOCK_FILE": str(block), "QUEUE_NODE_HANDLER_TIMEOUT_S": "2"},
        rows=n,
    )
    records = tmp_path / "records"
    blocked = wait_for(lambda: read_records(records, "blocked"), 20, "a blocked batch")[0]
    keys = set(blocked["keys"])

    def released_with_timeout():
        found = {k: h for k, h in held(node).items() if k in keys}
        return found if set(found) == keys else False

    found = wait_for(released_with_timeout, 10, "the blocked batch released")
    assert {h["last_error"] for h in found.values()} == {"handler timeout after 2s"}
    wait_for(lambda: blocked["pid"] not in node.pids()["inference"], 10, "a fresh process")
    collect_results(node, set(keys_of(n)), 40)
    doc = accounting(node)
    assert doc["released"] >= len(keys) and doc["finished"] == n and doc["balanced"], doc
    assert "action=handler_timeout" in node.log()


def test_routes_with_their_own_handler_never_share_a_batch(start_node, tmp_path) -> None:
    config = tmp_path / "node.toml"
    config.write_text('[routes.b]\nhandler = "tests.handlers:RecorderB"\n')
    node = start_node(
        "--config", str(config), "--handler", "tests.handlers:Recorder", "--inference-procs", "2"
    )
    seed(node, 40, route="a", prefix="a")
    seed(node, 40, route="b", prefix="b")
    results = collect_results(
        node, {f"a-{i:04d}" for i in range(40)} | {f"b-{i:04d}" for i in range(40)}, 30
    )
    assert {results[f"a-{i:04d}"]["tag"] for i in range(40)} == {"recorder"}
    assert {results[f"b-{i:04d}"]["tag"] for i in range(40)} == {"b"}
    for batch in read_records(tmp_path / "records", "batch"):
        prefixes = {k[0] for k in batch["keys"]}
        assert len(prefixes) == 1, batch


def test_sigterm_lets_the_running_batch_finish_and_logs_a_summary(start_node, tmp_path) -> None:
    block = tmp_path / "block"
    block.write_text("")
    node = start_node(
        "--handler",
        "tests.handlers:blocker",
        "--inference-procs",
        "1",
        "--lease-s",
        "1",
        env={"QN_TEST_BLOCK_FILE": str(block), "QN_TEST_BLOCK_S": "1.5"},
        rows=10,
    )
    records = tmp_path / "records"
    blocked = wait_for(lambda: read_records(records, "blocked"), 20, "a running batch")[0]
    assert len(blocked["keys"]) == 10  # one batch holds every row
    assert node.stop() == 0
    text = node.log_path.read_text()
    stops = [line for line in text.splitlines() if "action=inference_stop" in line]
    assert len(stops) == 1, text[-3000:]
    # A clean stop (not a drain timeout) that completed the running batch.
    assert "reason=" not in stops[0] and " completed=10 " in stops[0], stops[0]
    node = start_node("--handler", "tests.handlers:Recorder", "--inference-procs", "1")
    doc = accounting(node)
    assert doc["finished"] == 10 and doc["released"] == 0 and doc["expired"] == 0, doc
