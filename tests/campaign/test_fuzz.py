"""Acceptance: a property-based fuzz of the HTTP API, driven by the node's own
``GET /openapi.json`` (schemathesis), against a real ``python -m node run``.

For every operation the document describes, schemathesis draws requests that
fit the document (positive) and requests that break it (negative: wrong
types, values out of range, missing fields), in JSON and in msgpack. Each
answer is checked for:

- no 5xx, ever (``not_a_server_error``): nothing a caller sends is the node's
  fault;
- the document tells the truth: the status is one it lists
  (``status_code_conformance``), the body has the content type and the schema
  it gives (``content_type_conformance``, ``response_schema_conformance``),
  and a request that breaks the document is refused with a 4xx
  (``negative_data_rejection``);
- every error is the contract's ``{"error": {"code", "message", "field"}}``
  with a code from ``ERROR_CODES``.

Failures are collected, not raised at the first: the run reports how many
requests it tried and the distinct failures it found (by operation, check and
status). At the end the node must be healthy with the same processes it
started with (``node.json``'s pids): a request that crashed a worker would
show as a restarted pid even when the answer looked fine.

The default run is bounded (``FUZZ_S``, about 20 s); ``--run-slow`` adds a long
one (``LONG_FUZZ_S``), and ``scripts/fuzz`` runs that with the counts printed.
``QUEUE_NODE_FUZZ_S`` and ``QUEUE_NODE_FUZZ_SEED`` override the duration and
the seed; a failing run's seed (printed) reproduces its requests.

What this fuzz found, each fixed (regression tests in tests/acceptance/test_bad_input.py
and here): the document said every POST needs the token on a node that has
none; it gave the console's files as text/plain; GET endpoints ignored query
parameters they do not know (``?maxx=5`` polled the default 100), now
``400 unknown_field``. Found by hand beside it (tests/acceptance/test_bad_input.py): an
ack of an id past 2**64 was a 500, and ``GET /rows?key=%FF`` looked up U+FFFD.
Reproduce a run's counts with ``QUEUE_NODE_FUZZ_SEED=<seed>`` and the same
duration (the counts vary a little with timing: a round ends at the deadline).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from requests.structures import CaseInsensitiveDict
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from node.testing import NodeProcess, wait_for
from workers.http.errors import ERROR_CODES

FUZZ_S = float(os.environ.get("QUEUE_NODE_FUZZ_S", "20"))
LONG_FUZZ_S = float(os.environ.get("QUEUE_NODE_LONG_FUZZ_S", "600"))
# Requests drawn per operation and mode before moving to the next: small, so
# a bounded run still visits every operation many times over.
EXAMPLES_PER_ROUND = 8
# Long polls are bounded by the contract (wait_s <= 60); a fuzz that waited
# that long on every drawn poll would try a handful of requests. Valid waits
# are cut to this; out-of-range ones are sent as drawn.
FUZZ_WAIT_S = 0.05
REQUEST_TIMEOUT_S = 30.0
SEED_ROWS = 200

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@schemathesis.serializer("application/msgpack")
def _to_msgpack(ctx: Any, value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


@dataclass
class FuzzReport:
    seed: int
    requests: int = 0
    rounds: int = 0
    unsendable: int = 0  # msgpack bodies with integers msgpack cannot encode
    by_status: Counter = field(default_factory=Counter)
    # (operation, what failed, status) -> an example, for the report
    failures: dict[tuple[str, str, int], str] = field(default_factory=dict)

    def record(self, label: str, kind: str, status: int, example: str) -> None:
        self.failures.setdefault((label, kind, status), example)

    def summary(self) -> str:
        statuses = dict(sorted(self.by_status.items()))
        lines = [
            f"fuzz seed {self.seed}: {self.requests} requests in {self.rounds} rounds "
            f"({self.unsendable} not sendable as msgpack), "
            f"{len(self.failures)} distinct failures; statuses {statuses}"
        ]
        for (label, kind, status), example in sorted(self.failures.items()):
            lines.append(f"  {label} [{status}] {kind}: {example[:400]}")
        return "\n".join(lines)


def _cut_long_polls(case: Any) -> None:
    query = case.query or {}
    raw = query.get("wait_s")
    try:
        wait_s = float(raw)
    except (TypeError, ValueError):
        return
    if 0 <= wait_s <= 60:
        query["wait_s"] = FUZZ_WAIT_S


def _error_shape_problem(response: Any) -> str | None:
    """Why an error answer is not the contract's shape (None: it is)."""
    if response.status_code < 400:
        return None
    try:
        doc = json.loads(response.content)
    except ValueError:
        return f"not JSON: {response.content[:200]!r}"
    error = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(error, dict) or set(error) != {"code", "message", "field"}:
        return f"not the error shape: {doc!r}"
    if error["code"] not in ERROR_CODES:
        return f"unknown code {error['code']!r}"
    if ERROR_CODES[error["code"]][0] != response.status_code:
        return f"code {error['code']} with status {response.status_code}"
    return None


def _guarded(case: Any) -> bool:
    """The document says this operation needs the token."""
    return any("bearer" in option for option in case.operation.definition.raw.get("security", []))


def _sends_nothing(value: Any) -> bool:
    """Whether requests sends nothing for a query parameter with this value:
    None, or an iterable whose every item is None or an empty list or
    object (requests' ``_encode_params`` drops those)."""
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        return value is None
    return all(
        item is None or (not isinstance(item, str | bytes) and hasattr(item, "__len__")
                         and len(item) == 0)
        for item in value
    )  # fmt: skip


def _as_sent(case: Any, token: str | None) -> None:
    """Make the case the request that goes out, so that schemathesis judges
    that one: it checks a case whose containers changed in place again, and
    a negative case that became valid is held to a valid one's answers. The
    token goes into its headers (passed to ``call`` instead, the case kept
    the generated headers, and one drawn without the token counted as
    invalid though it went out with it); a query parameter the client sends
    nothing for leaves the query. Together these made the long fuzz with a
    token report valid requests as "Schema-violating request accepted"."""
    if token:
        case.headers["Authorization"] = f"Bearer {token}"
    query = case.query
    if isinstance(query, dict):
        for name in [name for name, value in query.items() if _sends_nothing(value)]:
            del query[name]
    _ = case.meta  # checked again now, before a call freezes what it knows


def _without_the_token(case: Any, base_url: str, session: Any, report: FuzzReport) -> None:
    """A guarded operation without the token: 401, whatever the body."""
    label = case.operation.label
    headers = {k: v for k, v in case.headers.items() if k.lower() != "authorization"}
    probe = case.derive(headers=CaseInsensitiveDict(headers))
    try:
        response = probe.call(base_url=base_url, session=session, timeout=REQUEST_TIMEOUT_S)
    except OverflowError:
        return
    report.requests += 1
    report.by_status[response.status_code] += 1
    if response.status_code != 401:
        report.record(label, "answered without the token", response.status_code,
                      _describe(case, response))


def _one_case(
    case: Any, base_url: str, session: Any, report: FuzzReport, token: str | None
) -> None:
    _cut_long_polls(case)
    _as_sent(case, token)
    label = case.operation.label
    if token and _guarded(case):
        _without_the_token(case, base_url, session, report)
    try:
        response = case.call(base_url=base_url, session=session, timeout=REQUEST_TIMEOUT_S)
    except OverflowError:
        # An integer past 2**64 drawn for a msgpack body: msgpack cannot carry
        # it, so no client can send it (JSON bodies do carry it).
        report.unsendable += 1
        return
    except Exception as exc:  # noqa: BLE001 - a dropped connection is a finding
        report.record(label, f"no answer: {type(exc).__name__}", 0, repr(exc))
        return
    report.requests += 1
    report.by_status[response.status_code] += 1
    if response.status_code >= 500:
        report.record(label, "server error", response.status_code, _describe(case, response))
    problem = _error_shape_problem(response)
    if problem is not None:
        report.record(label, "error shape", response.status_code, problem)
    try:
        case.validate_response(response, checks=CHECKS)
    except FailureGroup as group:
        for failure in group.exceptions:
            report.record(
                label, failure.title, response.status_code, _describe(case, response, failure)
            )
    except Failure as failure:
        example = _describe(case, response, failure)
        report.record(label, failure.title, response.status_code, example)


def _describe(case: Any, response: Any, failure: Failure | None = None) -> str:
    sent = {"query": case.query, "path": case.path_parameters, "body": case.body}
    text = response.content[:300]
    why = f"{failure.message} | " if failure is not None else ""
    return f"{why}sent {sent!r:.300} -> {text!r}"


def _run_operation(
    operation: Any,
    mode: Any,
    base_url: str,
    session: Any,
    report: FuzzReport,
    run_seed: int,
    token: str | None,
) -> None:
    @seed(run_seed)
    @settings(
        max_examples=EXAMPLES_PER_ROUND,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def draw(case: Any) -> None:
        _one_case(case, base_url, session, report, token)

    draw()


def run_fuzz(
    node: NodeProcess, seconds: float, run_seed: int, token: str | None = None
) -> FuzzReport:
    """Fuzz every operation of the node's document, round-robin in both modes,
    until ``seconds`` have passed (every operation gets at least one round)."""
    import requests

    report = FuzzReport(seed=run_seed)
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    schema = schemathesis.openapi.from_url(node.base_url + "/openapi.json", headers=auth)
    operations = [result.ok() for result in schema.get_all_operations()]
    pairs = [
        (operation, mode)
        for operation in operations
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    ]
    rng = random.Random(run_seed)
    deadline = time.monotonic() + seconds
    rounds = 0
    with requests.Session() as session:
        while rounds == 0 or time.monotonic() < deadline:
            for operation, mode in list(pairs):
                try:
                    _run_operation(
                        operation,
                        mode,
                        node.base_url,
                        session,
                        report,
                        rng.getrandbits(32),
                        token,
                    )
                except Unsatisfiable:
                    # Nothing to break (GET /healthz has no input): no negative cases.
                    pairs.remove((operation, mode))
            rounds += 1
    report.rounds = rounds
    return report


def _seed_rows(node: NodeProcess, headers: dict[str, str]) -> None:
    """Rows to find, claim and complete: some due now, some later."""
    now = time.time()
    rows = [
        {"key": f"fuzz-{i}", "route": "r", "due_at": now - 600 if i % 2 else now + 3600}
        for i in range(SEED_ROWS)
    ]
    status, _ = node.request("POST", "/rows", rows, headers=headers)
    assert status == 200


def _fuzz_node(tmp_path: Path, node_name: str, seconds: float, token: str | None = None) -> None:
    run_seed = int(os.environ.get("QUEUE_NODE_FUZZ_SEED", random.randrange(1 << 32)))
    args = ["--lease-s", "5", *(["--token", token] if token else [])]
    node = NodeProcess(tmp_path / "node", node_name, *args).start()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        _seed_rows(node, headers)
        pids = node.pids()
        report = run_fuzz(node, seconds, run_seed, token)
        print(report.summary())
        status, health = node.request("GET", "/healthz")
        assert status == 200 and health["ok"], health
        assert node.pids() == pids, "a process of the node was restarted during the fuzz"
        assert node.proc is not None and node.proc.poll() is None
        assert "Traceback" not in node.log(), node.log()
        assert report.requests > 0
        assert not report.failures, report.summary()
        # The output side balances exactly. The fuzz writes rows while they
        # are leased, the input law's one edge (docs/accounting.md): its gap
        # stays within the writes to leased rows the keeper counted.
        last: dict[str, Any] = {}

        def settled() -> bool:
            last.update(node.request("GET", "/accounting", headers=headers)[1])
            gaps = last.get("gaps") or {}
            return (
                gaps.get("output") == 0
                and gaps.get("finished") == 0
                and gaps.get("input") is not None
                and abs(gaps["input"]) <= (gaps.get("input_edges") or 0)
            )

        try:
            wait_for(settled, 30, "the ledger balanced after the fuzz")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {last}") from None
        print("accounting after the fuzz:", last)
    finally:
        assert node.stop() == 0, node.log()


@pytest.mark.timeout(int(FUZZ_S) + 120)
def test_fuzz_finds_no_5xx_and_no_crash(tmp_path: Path, node_name: str) -> None:
    _fuzz_node(tmp_path, node_name, FUZZ_S)


@pytest.mark.slow
@pytest.mark.timeout(int(LONG_FUZZ_S) + 180)
def test_long_fuzz(tmp_path: Path, node_name: str) -> None:
    _fuzz_node(tmp_path, node_name, LONG_FUZZ_S)


@pytest.mark.slow
@pytest.mark.timeout(int(LONG_FUZZ_S) + 180)
def test_long_fuzz_with_a_token(tmp_path: Path, node_name: str) -> None:
    """The same with a token: every guarded operation is also sent without
    it (401 expected), the rest with it."""
    _fuzz_node(tmp_path, node_name, LONG_FUZZ_S, token="fuzz-token-0123456789")


@pytest.mark.parametrize(
    "value",
    [None, [], [[]], [{}], [None], [[], {}, None], (), {}, "", "x", 0, 1.5, [""], ["x"], [[1]],
     [{"a": 1}], {"a": 1}, [0], [False], b"", [b""]],
)  # fmt: skip
def test_what_the_client_sends_nothing_for(value: Any) -> None:
    """``_sends_nothing`` against requests' own encoding of a query."""
    from requests.models import RequestEncodingMixin

    sent = RequestEncodingMixin._encode_params({"a": value})
    assert _sends_nothing(value) == (sent == ""), sent


def test_the_document_follows_the_token_and_the_console_types() -> None:
    """Regressions of the document (found by the fuzz): without a token no
    operation asks for one; with a token all but the open routes do; the
    console's files have their own content types."""
    from workers.http import openapi

    def guarded(doc: dict) -> set[tuple[str, str]]:
        return {
            (method, path)
            for path, ops in doc["paths"].items()
            for method, op in ops.items()
            if any("bearer" in option for option in op.get("security", []))
        }

    assert guarded(openapi.spec(token=False)) == set()
    with_token = guarded(openapi.spec(token=True))
    assert ("post", "/rows") in with_token and ("get", "/results") in with_token
    from workers.http.errors import OPEN_ROUTES

    every = {(m, p) for p, ops in openapi.spec(token=True)["paths"].items() for m in ops}
    assert with_token == {(m, p) for m, p in every if (m.upper(), p) not in OPEN_ROUTES}
    console = openapi.spec()["paths"]["/console/{name}"]["get"]["responses"]["200"]
    assert set(console["content"]) == {"text/html", "text/javascript", "text/css"}
