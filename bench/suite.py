"""The steps of ``python -m bench``: which bench script runs with which
arguments (quick and full), and how its ``--json`` output becomes figures.

A figure is one record: ``name`` (``group.what.detail``), ``value`` (``None``
when it was not measured, with ``not_run`` saying why), ``unit``, ``setup``
(rows, batch, procs, seconds... as the step ran it), ``command`` (the line
that measured it) and, where issue 16 sets one, ``target`` with ``better``
(``"lower"`` or ``"higher"``). ``bench/__main__.py`` adds the machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Fig = dict[str, Any]


def fig(name: str, value: Any, unit: str, setup: dict | None = None, **extra: Any) -> Fig:
    """One figure; ``target=``/``better=``/``not_run=`` go in ``extra``."""
    if isinstance(value, float):
        value = round(value, 4)
    return {"name": name, "value": value, "unit": unit, "setup": dict(setup or {}), **extra}


@dataclass(frozen=True)
class Step:
    """One run of one bench script. ``argv`` is what follows ``python``;
    ``quick``/``full`` are the sizes; ``figures`` turns the script's
    ``--json`` list into figures (the step's arguments as a dict beside it)."""

    name: str
    argv: tuple[str, ...]
    quick: tuple[str, ...]
    full: tuple[str, ...]
    figures: Callable[[list[dict], dict], list[Fig]]
    timeout_s: tuple[float, float] = (300.0, 3600.0)  # quick, full
    env: dict[str, tuple[str, str]] = field(default_factory=dict)  # name: (quick, full)
    json_flag: str = "--json"  # the option that names the script's JSON output


def _size(args: tuple[str, ...], flag: str, default: Any = None) -> Any:
    """The value after ``flag`` in ``args`` (a number when it reads as one)."""
    if flag not in args:
        return default
    value = args[args.index(flag) + 1]
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


# -- the whole cycle and the claims, with the peers ---------------------------------------

CYCLE_TARGETS = {
    "cycle.ratio.node_local_over_postgres.batch64": 5.0,
    "cycle.ratio.node_local_over_postgres.batch1": 1.5,
    "cycle.ratio.node_http_over_postgres.batch64": 1.5,
}


def cycle_figures(docs: list[dict], _setup: dict) -> list[Fig]:
    """bench_cycle.py writes figures already; the issue's targets are added."""
    out = []
    for doc in docs:
        rec = {k: v for k, v in doc.items() if k != "machine"}
        if rec["name"] in CYCLE_TARGETS:
            rec.update(target=CYCLE_TARGETS[rec["name"]], better="higher")
        if rec["name"].endswith(".lost"):
            rec.update(target=0, better="lower")
        out.append(rec)
    return out


CLAIM_PEERS = ("postgres_skip_locked", "pgqueuer", "redis_lua")


def claims_figures(docs: list[dict], setup: dict) -> list[Fig]:
    out = []
    rate: dict[tuple[str, int], float] = {}
    for doc in docs:
        where = {**setup, "batch": doc["batch"]}
        for k in ("rows", "procs", "layout", "drained"):
            if k in doc:
                where[k] = doc[k]
        if "seconds" in doc:  # the window measured: shorter than asked when drained
            where["window_s"] = doc["seconds"]
        name = f"claims.{doc['variant']}.batch{doc['batch']}"
        if "not_run" in doc:
            out.append(fig(f"{name}.grants_per_s", None, "grants/s", where,
                           not_run=doc["not_run"]))  # fmt: skip
            continue
        rate[(doc["variant"], doc["batch"])] = doc["grants_per_s"]
        out.append(fig(f"{name}.grants_per_s", doc["grants_per_s"], "grants/s", where))
        out.append(fig(f"{name}.p50_ms", doc.get("p50_ms"), "ms", where))
        out.append(fig(f"{name}.p99_ms", doc.get("p99_ms"), "ms", where))
    for (variant, batch), value in sorted(rate.items()):
        if not variant.startswith("node_"):
            continue
        for peer in CLAIM_PEERS:
            theirs = rate.get((peer, batch))
            if theirs:
                out.append(fig(f"claims.ratio.{variant}_over_{peer}.batch{batch}",
                               value / theirs, "x", {**setup, "batch": batch}))  # fmt: skip
    return out


def complete_http_figures(docs: list[dict], setup: dict) -> list[Fig]:
    out = []
    for doc in docs:
        where = {**setup, **{k: doc[k] for k in ("procs", "batch", "seconds", "rows") if k in doc}}
        name = f"complete_http.{doc['mode']}"
        out.append(fig(f"{name}.completed_per_s", doc["completed_per_s"], "items/s", where))
        out.append(fig(f"{name}.requests_per_s", doc["requests_per_s"], "requests/s", where))
        out.append(fig(f"{name}.cycle_p50_ms", doc["cycle_p50_ms"], "ms", where))
    return out


# -- the keeper -----------------------------------------------------------------------------


def publish_figures(docs: list[dict], setup: dict) -> list[Fig]:
    out = []
    for doc in docs:
        where = {**setup, "rows": doc["rows"], "ready_size": doc["ready_size"],
                 "grants_per_round": doc["grants_per_round"], "live_leases": doc["live_leases"],
                 "rounds": doc["rounds_measured"]}  # fmt: skip
        for phase in ("decision_to_written", "best_to_written", "publish"):
            out.append(fig(f"keeper.publish.{phase}_p50_ms", doc[f"{phase}_p50_ms"], "ms", where))
            out.append(fig(f"keeper.publish.{phase}_max_ms", doc[f"{phase}_max_ms"], "ms", where))
        for key, value in doc.items():
            if key.startswith("best_written_excl") and key.endswith("_p50_ms"):
                n = key.removeprefix("best_written_excl").removesuffix("_p50_ms")
                extra = {"target": 0.5, "better": "lower"} if n != "0" else {}
                out.append(fig(f"keeper.publish.best{doc['ready_size']}_written_excl{n}_p50_ms",
                               value, "ms", {**where, "excluded": int(n)}, **extra))  # fmt: skip
    return out


def feed_figures(docs: list[dict], setup: dict) -> list[Fig]:
    return [
        fig(
            "keeper.feed.apply_us_per_change",
            d["apply_us_per_change"],
            "us",
            {**setup, "rows": d["rows"], "changes": d["changes"]},
        )  # fmt: skip
        for d in docs
    ]


# exec -> live and exact (issue 16: <= 0.9 s at 250,000 rows, <= 3.6 s at 1,000,000)
STARTUP_TARGETS = {250_000: 0.9, 1_000_000: 3.6}


def startup_figures(docs: list[dict], setup: dict) -> list[Fig]:
    out = []
    by_rows: dict[int, list[dict]] = {}
    for doc in docs:
        by_rows.setdefault(doc["rows"], []).append(doc)
    for rows, runs in sorted(by_rows.items()):
        where = {**setup, "rows": rows, "attempts": len(runs)}
        live = sorted(r["live_exact_s"] for r in runs if r.get("live_exact_s") is not None)
        first = sorted(r["first_publish_s"] for r in runs if r.get("first_publish_s") is not None)
        uss = sorted(r["keeper_uss_bytes"] for r in runs if r.get("keeper_uss_bytes"))
        target = STARTUP_TARGETS.get(rows)
        extra = {"target": target, "better": "lower"} if target else {}
        name = f"keeper.startup.rows{rows}"
        out.append(fig(f"{name}.live_exact_s", _median(live), "s", where, **extra))
        out.append(fig(f"{name}.first_publish_s", _median(first), "s", where))
        out.append(fig(f"{name}.keeper_uss_bytes", _median(uss), "bytes", where))
    return out


def lag_figures(docs: list[dict], setup: dict) -> list[Fig]:
    out = []
    for doc in docs:
        where = {**setup, "rows": doc["rows"], "target_rate": doc["target_rate"]}
        out.append(fig("keeper.lag.achieved_writes_per_s", doc["achieved_rate"], "writes/s", where))
        lag = doc.get("lag") or {}
        node = lag.get("node") or {}
        # The target is the lag from the writer's commit returning (issue 16);
        # the keeper's own figure starts at the change's statement, before it.
        commit = doc.get("from_commit") or {}
        out.append(fig("keeper.lag.from_commit_p50_ms", commit.get("p50_ms"), "ms", where))
        out.append(fig("keeper.lag.from_commit_p99_ms", commit.get("p99_ms"), "ms", where,
                       target=5.0, better="lower"))  # fmt: skip
        out.append(fig("keeper.lag.node_p50_ms", node.get("p50_ms"), "ms", where))
        out.append(fig("keeper.lag.node_p99_ms", node.get("p99_ms"), "ms", where))
        out.append(fig("keeper.lag.apply_us", lag.get("apply_us"), "us", where))
    return out


BUCKET_FIGURES = {  # bench_buckets.py's figure: (unit, target, better)
    "rss_bytes_per_row": ("bytes", 160.0, "lower"),
    "traced_bytes_per_row": ("bytes", None, "lower"),
    "load_rows_us_per_row": ("us", 1.0, "lower"),
    "apply_us": ("us", 10.0, "lower"),
    "apply_p99_us": ("us", None, "lower"),
    "best5000_ms": ("ms", 1.0, "lower"),
    "best5000_excl3000_paused2_ms": ("ms", None, "lower"),
    "counts_next_minute_ms": ("ms", 1.0, "lower"),
    "table_doubling_pause_ms": ("ms", 50.0, "lower"),
}


def buckets_figures(docs: list[dict], setup: dict) -> list[Fig]:
    out = []
    for doc in docs:
        where = {**setup, "rows": doc["rows"], "changes": doc.get("changes"),
                 "layout": doc.get("layout")}  # fmt: skip
        for key, (unit, target, better) in BUCKET_FIGURES.items():
            if key in doc:
                extra = {"target": target, "better": better} if target else {}
                out.append(fig(f"keeper.buckets.{key}", doc[key], unit, where, **extra))
    return out


# The state document's class counts: the 18 classes the target is set at,
# and the 1,000 it is reported at (bench_state.py makes 1,002: 6 a route).
STATE_MANY_CLASSES = 1000


def state_figures(docs: list[dict], setup: dict) -> list[Fig]:
    out = []
    for doc in docs:
        where = {**setup, "rows": doc["rows"], "classes": doc["classes"], "calls": doc["calls"]}
        if doc["classes"] >= STATE_MANY_CLASSES:  # reported, no target
            name = f"keeper.state_doc.classes{STATE_MANY_CLASSES}"
            out.append(fig(f"{name}.p50_ms", doc["p50_ms"], "ms", where))
        else:
            name = f"keeper.state_doc.rows{doc['rows']}"
            out.append(fig(f"{name}.p50_ms", doc["p50_ms"], "ms", where, target=0.5,
                           better="lower"))  # fmt: skip
        out.append(fig(f"{name}.p99_ms", doc["p99_ms"], "ms", where))
    return out


# -- the completion log, delivery and the store's writes --------------------------------------


def commit_figures(docs: list[dict], setup: dict) -> list[Fig]:
    out = []
    for doc in docs:
        where = {**setup, "batch": doc["batch"], "result_bytes": doc["result_bytes"],
                 "fsync": doc["fsync"]}  # fmt: skip
        name = f"completion.commit.batch{doc['batch']}"
        out.append(fig(f"{name}.durable_per_s", doc["durable_per_s"], "results/s", where))
        out.append(fig(f"{name}.flush_ms_p50", doc["flush_ms_p50"], "ms", where))
    return out


def recover_figures(docs: list[dict], setup: dict) -> list[Fig]:
    out = []
    for doc in docs:
        where = {**setup, "results": doc["results"], "result_bytes": doc["result_bytes"],
                 "pending_fraction": doc["pending_fraction"]}  # fmt: skip
        target = {"target": doc["target_s"], "better": "lower"}
        out.append(fig("completion.recover.warm_s", doc["warm_best_s"], "s", where, **target))
        out.append(fig("completion.recover.cold_s", doc["cold_s"], "s", where))
        out.append(fig("completion.recover.warm_results_per_s", doc["warm_results_per_s"],
                       "results/s", where))  # fmt: skip
    return out


def poll_figures(docs: list[dict], setup: dict) -> list[Fig]:
    out = []
    for doc in docs:
        if doc.get("bench") != "poll_latency":
            continue
        for row in doc["sizes"]:
            where = {**setup, "backlog": row["size"], "max": 100}
            name = f"delivery.poll.backlog{row['size']}"
            out.append(fig(f"{name}.one_job_p50_ms", row["one_job"]["p50_ms"], "ms", where))
            out.append(fig(f"{name}.all_jobs_p50_ms", row["all_jobs"]["p50_ms"], "ms", where))
        out.append(fig("delivery.poll.ratio_largest_over_smallest", doc["ratio_one_job"], "x",
                       setup, target=doc["target_ratio"], better="lower"))  # fmt: skip
    return out


def sync_figures(docs: list[dict], setup: dict) -> list[Fig]:
    out = []
    per_txn_us: dict[tuple[str, int, str], float] = {}
    for doc in docs:
        where = {**setup, "rows": doc.get("rows"), "per_txn": doc["per_txn"],
                 "synchronous": doc["synchronous"]}  # fmt: skip
        name = f"store.sync.{doc['op']}{doc['per_txn']}.{doc['synchronous'].lower()}"
        per_txn_us[(doc["op"], doc["per_txn"], doc["synchronous"])] = doc["us_per_txn"]
        out.append(fig(f"{name}.us_per_txn", doc["us_per_txn"], "us", where))
        out.append(fig(f"{name}.us_per_row", doc["us_per_row"], "us", where))
    for (op, per_txn, mode), us in sorted(per_txn_us.items()):
        normal = per_txn_us.get((op, per_txn, "NORMAL"))
        if mode == "FULL" and normal is not None:
            out.append(fig(f"store.sync.{op}{per_txn}.full_minus_normal_us_per_txn", us - normal,
                           "us", {**setup, "per_txn": per_txn}))  # fmt: skip
    return out


def pg_store_figures(docs: list[dict], setup: dict) -> list[Fig]:
    """bench/bench_pg_store.py: each store's bulk upsert, write-back at 64 a
    group and change-log read, in one run (issue 18, item 1)."""
    out = []
    units = {"upsert_rows_per_s": "rows/s", "write_back_us_per_row": "us",
             "write_back_durable_us_per_row": "us", "changes_us_per_change": "us"}  # fmt: skip
    for doc in docs:
        where = {**setup, "rows": doc["rows"], "batch": doc["batch"], "group": doc["group"]}
        for key, unit in units.items():
            out.append(fig(f"store.{doc['store']}.{key}", doc[key], unit, where))
    return out


def write_back_figures(docs: list[dict], setup: dict) -> list[Fig]:
    """bench/bench_write_back.py: the CPU of a group's write-back in SQLite,
    as the schema is and without the change log's trigger, a figure a round
    (the round in its setup)."""
    out = []
    for doc in docs:
        where = {**setup, "group": doc["group"], "groups": doc["groups"],
                 "round": doc.get("round", 0)}  # fmt: skip
        name = f"store.sqlite.write_back.{doc['way'].replace('-', '_')}"
        out.append(fig(f"{name}.us_per_row", doc["us_a_row"], "us", where))
        out.append(fig(f"{name}.statement_ms", doc["statement_ms"], "ms", where))
        out.append(fig(f"{name}.commit_ms", doc["commit_ms"], "ms", where))
    return out


def ledger_figures(docs: list[dict], setup: dict) -> list[Fig]:
    out = []
    for doc in docs:
        where = {**setup, "clients": doc["clients"], "per_call": doc["per_call"],
                 "per_client": doc.get("per_client"), "result_bytes": 1024}  # fmt: skip
        name = f"ledger.per_call{doc['per_call']}"
        out.append(fig(f"{name}.completions_per_s", doc["completions_per_s"], "items/s", where))
        out.append(fig(f"{name}.cpu_us_per_item", doc["ledger_cpu_us_per_item"], "us", where))
        out.append(fig(f"{name}.items_per_group", doc["items_per_group"], "items", where))
        out.append(fig(f"{name}.balanced", doc["balanced"], "bool", where))
    return out


def ledger_cpu_figures(docs: list[dict], setup: dict) -> list[Fig]:
    """The ledger's CPU a completed, delivered and acked item, in process
    (bench/bench_ledger_cpu.py): the whole cycle's bound at batch 64."""
    out = []
    for doc in docs:
        where = {**setup, "batch": doc["batch"], "items": doc["completed"]}
        out.append(fig(f"ledger.in_process.batch{doc['batch']}.cpu_us_per_item",
                       doc["us_per_item"], "us", where))  # fmt: skip
    return out


def churn_figures(docs: list[dict], setup: dict) -> list[Fig]:
    """bench/bench_churn.py's own records (``{"records": [...], "run": ...}``)."""
    out = []
    for doc in docs:
        for r in doc["records"]:
            out.append(fig(r["name"], r["value"], r["unit"], {**setup, **r["setup"]}))
    return out


def store_error_figures(docs: list[dict], setup: dict) -> list[Fig]:
    """bench/bench_keeper_store_error.py: seconds from the store back (or the
    keeper killed) to queue-state 200, by way (resume, walk, reload)."""
    return [fig(d["name"] + ".back_to_exact_s", d["value"], d["unit"], {**setup, **d["setup"]})
            for d in docs]  # fmt: skip


# -- the micro benchmarks (pytest-benchmark) --------------------------------------------------


def micro_figures(docs: list[dict], setup: dict) -> list[Fig]:
    """pytest-benchmark's JSON: the median of a round over the operations it
    timed (``extra_info["ops"]``), in µs an operation."""
    out = []
    for doc in docs:
        for bench in doc.get("benchmarks", []):
            extra = bench.get("extra_info", {})
            ops = extra.get("ops", 1)
            name = bench["name"].removeprefix("test_").replace("[", ".").rstrip("]")
            where = {**setup, **extra, "rounds": bench["stats"]["rounds"]}
            median_us = bench["stats"]["median"] * 1e6 / ops
            out.append(fig(f"micro.{name}.median_us", median_us, "us", where))
    return out


def _median(values: list) -> Any:
    return values[(len(values) - 1) // 2] if values else None


# -- the suite --------------------------------------------------------------------------------

STEPS: tuple[Step, ...] = (
    Step("cycle", ("bench/bench_cycle.py",),
         ("--rows", "20000", "--seconds", "5"), ("--rows", "200000", "--seconds", "15"),
         cycle_figures, (600.0, 3600.0)),
    Step("claims", ("bench/bench_claims.py",),
         ("--rows", "20000", "--seconds", "3", "--batch", "64",
          "--external", "postgres_skip_locked", "redis_lua"),
         ("--rows", "250000", "--seconds", "10"), claims_figures),
    Step("complete_http", ("bench/bench_complete_http.py",),
         ("--rows", "20000", "--seconds", "3"), ("--rows", "200000", "--seconds", "15"),
         complete_http_figures),
    Step("ledger", ("bench/bench_ledger.py",), ("2", "3000", "64"), ("2", "50000", "64"),
         ledger_figures),
    Step("ledger_cpu", ("bench/bench_ledger_cpu.py",), ("--rows", "20000", "--items", "20000"),
         ("--rows", "50000", "--items", "40000"), ledger_cpu_figures),
    Step("publish", ("bench/bench_publish.py",),
         ("--rows", "20000", "--grants", "1000", "--window", "5", "--rounds", "40",
          "--reps", "50"), (), publish_figures),
    Step("keeper_feed", ("bench/bench_keeper.py", "feed"),
         ("--rows", "20000", "--changes", "22000"), ("--rows", "250000", "--changes", "110000"),
         feed_figures),
    Step("keeper_startup_empty", ("bench/bench_keeper.py", "startup"),
         ("--rows", "0", "--repeat", "1"), ("--rows", "0", "--repeat", "3"), startup_figures),
    Step("keeper_startup", ("bench/bench_keeper.py", "startup"),
         ("--rows", "20000", "--repeat", "1"), ("--rows", "250000", "--repeat", "3"),
         startup_figures),
    Step("keeper_startup_1m", ("bench/bench_keeper.py", "startup"),
         (), ("--rows", "1000000", "--repeat", "3"), startup_figures),
    Step("keeper_lag", ("bench/bench_keeper.py", "lag"),
         ("--rows", "20000", "--rate", "15000", "--seconds", "3"),
         ("--rows", "250000", "--rate", "15000", "--seconds", "10"), lag_figures),
    Step("keeper_store_error", ("bench/bench_keeper_store_error.py",),
         ("--rows", "20000", "--down-s", "1"), ("--rows", "1000000",), store_error_figures),
    Step("buckets", ("bench/bench_buckets.py", "--layout", "packed"),
         ("--rows", "50000", "--changes", "50000"), ("--rows", "1000000",), buckets_figures),
    Step("state_doc", ("bench/bench_state.py", "doc"),
         ("--rows", "20000", "--calls", "100"), ("--rows", "250000", "1000000"), state_figures),
    Step("state_doc_classes", ("bench/bench_state.py", "doc", "--classes", "1000"),
         ("--rows", "20000", "--calls", "20"), ("--rows", "1000000", "--calls", "100"),
         state_figures),
    Step("completion_commit", ("bench/bench_completion.py", "commit"),
         ("--seconds", "1"), ("--seconds", "3"), commit_figures),
    Step("completion_recover", ("bench/bench_completion.py", "recover"),
         ("--results", "100000", "--repeat", "1"), ("--results", "1000000",), recover_figures),
    Step("poll", ("bench/bench_poll.py",), ("--sizes", "1000", "10000", "--polls", "100"), (),
         poll_figures),
    Step("sync", ("bench/bench_sync.py",), ("--rows", "20000", "--seconds", "1"),
         ("--rows", "200000", "--seconds", "5"), sync_figures),
    Step("write_back", ("bench/bench_write_back.py",),
         ("--rows", "20000", "--groups", "100", "--repeat", "1"),
         ("--rows", "400000", "--groups", "400", "--repeat", "2"), write_back_figures),
    Step("pg_store", ("bench/bench_pg_store.py",), ("--rows", "20000", "--repeat", "1"),
         ("--rows", "200000", "--repeat", "3"), pg_store_figures),
    Step("churn", ("bench/bench_churn.py",), (), ("--rows", "1000000", "--minutes", "10"),
         churn_figures, (600.0, 3600.0)),
    Step("micro", ("-m", "pytest", "bench/micro", "-q"), (), (), micro_figures,
         env={"QN_MICRO_ROWS": ("20000", "1000000"), "QN_MICRO_RESULTS": ("20000", "1000000")},
         json_flag="--benchmark-json"),
)  # fmt: skip
QUICK_SKIPS = {"keeper_startup_1m", "churn"}  # full-only sizes

# Figures issue 16 names that no bench measures yet: reported, never dropped.
NOT_MEASURED = (
    fig("model.node_over_direct", None, "x", {"rows": 100_000, "procs": 2},
        not_run="bench/bench_model.py (the model extra; a 100,000-row round takes about 25 "
                "minutes on 2 CPU cores): not in the suite, run it on its own",
        target=0.98, better="higher"),
)  # fmt: skip


def keeper_memory(figures: list[Fig]) -> list[Fig]:
    """The keeper's bytes a row: its USS at N rows above an empty node's
    keeper, over N (issue 16: <= 150 B a row at 1,000,000 rows)."""
    uss = {
        f["setup"]["rows"]: f["value"]
        for f in figures
        if f["name"].startswith("keeper.startup.") and f["name"].endswith(".keeper_uss_bytes")
    }
    empty = uss.pop(0, None)
    out = []
    for rows, value in sorted(uss.items()):
        name = f"keeper.memory.rows{rows}.bytes_per_row"
        where = {"rows": rows, "from": f"keeper.startup.rows{rows}.keeper_uss_bytes minus "
                 "keeper.startup.rows0.keeper_uss_bytes, over rows"}  # fmt: skip
        target = {"target": 150.0, "better": "lower"}
        if value is None or empty is None:
            out.append(fig(name, None, "bytes", where, not_run="no USS figure", **target))
        else:
            out.append(fig(name, (value - empty) / rows, "bytes", where, **target))
    return out
