"""The soak's analysis and report (``bench/soak.py`` runs it): per process
the memory and file-descriptor verdicts, the segment files, the throughput,
the checks that make the verdict, and the printed report."""

from __future__ import annotations

from typing import Any

# The checks.
FD_TOLERANCE = 5
LEAK_MIB_PER_MIN = 1.0
SEGMENT_FILES_MAX = 3

MiB = 1 << 20


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (x, y); None with fewer than 2 points."""
    n = len(points)
    if n < 2:
        return None
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def rss_verdict(series: list[tuple[float, float]], duration_min: float) -> dict[str, Any]:
    """(minute, MiB) samples -> the slopes of the first and last thirds and
    whether the growth goes on at a constant rate (a leak)."""
    first = [p for p in series if p[0] <= duration_min / 3]
    last = [p for p in series if p[0] >= 2 * duration_min / 3]
    s_first, s_last = slope(first), slope(last)
    leak = (s_last is not None and s_last > LEAK_MIB_PER_MIN
            and (s_first is None or s_last >= 0.5 * s_first))  # fmt: skip
    if leak:
        verdict = "LEAK: still growing at a constant rate"
    elif s_last is not None and s_first is not None and s_first > LEAK_MIB_PER_MIN:
        verdict = "warm-up: grew early, then levelled off"
    else:
        verdict = "flat"
    return {
        "slope_first_mib_per_min": None if s_first is None else round(s_first, 3),
        "slope_last_mib_per_min": None if s_last is None else round(s_last, 3),
        "leak": leak,
        "verdict": verdict,
    }


def analyse(samples: list[dict], duration_s: float) -> dict[str, Any]:
    """Per process: start and end RSS and fds, the RSS slopes, restarts."""
    start, end = samples[0]["procs"], samples[-1]["procs"]
    out: dict[str, Any] = {}
    for role, first in start.items():
        last = end.get(role, {})
        pids = {s["procs"].get(role, {}).get("pid") for s in samples}
        series = [(s["t_s"] / 60, s["procs"][role]["uss"] / MiB) for s in samples
                  if "uss" in s["procs"].get(role, {}) and s["procs"][role]["pid"] == first["pid"]]
        doc = {
            "pid": first.get("pid"),
            "restarted": len(pids) > 1 or "error" in last,
            "rss_start_mib": round(first.get("rss", 0) / MiB, 1),
            "rss_end_mib": round(last.get("rss", 0) / MiB, 1),
            "uss_start_mib": round(first.get("uss", 0) / MiB, 1),
            "uss_end_mib": round(last.get("uss", 0) / MiB, 1),
            "shared_start_mib": round(first.get("shared", 0) / MiB, 1),
            "shared_end_mib": round(last.get("shared", 0) / MiB, 1),
            "fds_start": first.get("fds"),
            "fds_end": last.get("fds"),
            "threads_start": first.get("threads"),
            "threads_end": last.get("threads"),
            **rss_verdict(series, duration_s / 60),
        }
        doc["rss_growth_mib"] = round(doc["rss_end_mib"] - doc["rss_start_mib"], 1)
        doc["uss_growth_mib"] = round(doc["uss_end_mib"] - doc["uss_start_mib"], 1)
        # The fds once warmed up (an HTTP worker opens its store, ledger
        # connection and threads at its first requests): the most over the
        # first third. The end may not pass it by more than the tolerance.
        warm = [s["procs"][role].get("fds") for s in samples
                if s["t_s"] <= duration_s / 3 and role in s["procs"]]
        doc["fds_warm"] = max((f for f in warm if f is not None), default=None)
        fds = (doc["fds_warm"], doc["fds_end"])
        doc["fds_ok"] = None not in fds and fds[1] - fds[0] <= FD_TOLERANCE
        out[role] = doc
    return out


def segments_check(samples: list[dict]) -> dict[str, Any]:
    logs = [s["log"] for s in samples]
    end = logs[-1]
    rolled = end["highest"] > logs[0]["highest"] or end["highest"] > 1
    compacted = end["highest"] - end["files"] if end["files"] else 0
    return {
        "files_start": logs[0]["files"], "files_end": end["files"],
        "files_max": max(x["files"] for x in logs),
        "bytes_start": logs[0]["bytes"], "bytes_end": end["bytes"],
        "highest_segment": end["highest"], "removed_by_compaction": compacted,
        "rolled": rolled, "bounded": end["files"] <= SEGMENT_FILES_MAX,
    }  # fmt: skip


def throughput(samples: list[dict], duration_s: float) -> dict[str, Any]:
    a0 = samples[0].get("accounting") or {}
    a1 = samples[-1].get("accounting") or {}
    out = {}
    for term in ("routed", "finished", "acknowledged", "expired", "released"):
        if term in a0 and term in a1:
            out[f"{term}_per_s"] = round((a1[term] - a0[term]) / max(duration_s, 1e-9), 1)
    return out


def verdict(report: dict[str, Any], quiesce_timeout_s: float) -> list[str]:
    problems = []
    ledger = report["ledger"]
    if not report["quiescence"]["reached"]:
        problems.append(f"no quiescence within {quiesce_timeout_s:.0f} s after the load: "
                        f"in_flight {ledger.get('in_flight')}, "
                        f"awaiting_ack {ledger.get('awaiting_ack')}")  # fmt: skip
    if not ledger.get("balanced"):
        problems.append("the ledger did not balance")
    for role, p in report["processes"].items():
        if p["restarted"]:
            problems.append(f"{role} restarted (or died) during the soak")
        if not p["fds_ok"]:
            problems.append(f"{role}: open fds {p['fds_warm']} once warm -> {p['fds_end']} "
                            f"at the end (tolerance {FD_TOLERANCE})")  # fmt: skip
        if p["leak"]:
            problems.append(f"{role}: private memory (USS) still growing "
                            f"{p['slope_last_mib_per_min']} MiB/min in the last third "
                            f"({p['uss_start_mib']} -> {p['uss_end_mib']} MiB)")
    seg = report["segments"]
    if not seg["bounded"]:
        problems.append(f"{seg['files_end']} segment files at the end "
                        f"(at most {SEGMENT_FILES_MAX}): compaction does not keep up")
    problems += [f"load thread failed: {f}" for f in report["load"]["failed"]]
    if report["stop_rc"] != 0:
        problems.append(f"the node did not stop cleanly (exit status {report['stop_rc']})")
    return problems


# -- the report ----------------------------------------------------------------------------

LEDGER_ORDER = ("received", "routed", "finished", "acknowledged", "discarded", "expired",
                "released", "refused", "in_flight", "awaiting_ack")  # fmt: skip


def print_report(report: dict[str, Any]) -> None:
    p = report["params"]
    print(f"\nsoak of {report['duration_s'] / 60:.1f} min: {p['rows']} rows, writes "
          f"{p['write_rate']}/s, seed {p['seed']}, node {report['name']}")  # fmt: skip
    print(f"{'process':<12} {'pid':>7} {'RSS MiB':>13} {'shared':>13} {'USS MiB':>13} "
          f"{'USS slope 1st/last':>19} {'fds':>12} {'threads':>7}  verdict")
    for role, q in report["processes"].items():
        rss = f"{q['rss_start_mib']:.1f}->{q['rss_end_mib']:.1f}"
        shared = f"{q['shared_start_mib']:.1f}->{q['shared_end_mib']:.1f}"
        uss = f"{q['uss_start_mib']:.1f}->{q['uss_end_mib']:.1f}"
        slopes = (f"{_fmt(q['slope_first_mib_per_min'])}/"
                  f"{_fmt(q['slope_last_mib_per_min'])}")  # fmt: skip
        fds = f"{q['fds_start']}/{q['fds_warm']}->{q['fds_end']}"
        thr = f"{q['threads_start']}->{q['threads_end']}"
        print(f"{role:<12} {q['pid']:>7} {rss:>13} {shared:>13} {uss:>13} {slopes:>19} "
              f"{fds:>12} {thr:>7}  {q['verdict']}")
    print("  RSS = shared (the node's shared-memory segments and mapped files, as each process"
          " touches their pages) + USS (private);")
    print("  USS slopes in MiB/min, least squares over the first and last third of the samples;"
          " fds: start/once warm->end")
    seg = report["segments"]
    print(f"segment files: {seg['files_start']} -> {seg['files_end']} (max {seg['files_max']}), "
          f"{seg['bytes_start'] / MiB:.1f} -> {seg['bytes_end'] / MiB:.1f} MiB, highest "
          f"#{seg['highest_segment']}, {seg['removed_by_compaction']} removed by compaction"
          + ("" if seg["rolled"] else "; no roll to a second segment: compaction not exercised"))
    shm = report["shm_end"]
    print("shared memory: " + ", ".join(
        f"{n.split('.', 2)[-1]} {v['size'] / MiB:.1f} MiB ({v['resident'] / MiB:.1f} resident)"
        for n, v in shm.items()))  # fmt: skip
    live = report["live_data"]
    print(f"live data: rows {live['rows_start']} -> {live['rows_end']}, "
          f"due {live['due_start']} -> {live['due_end']}")
    tp = report["throughput"]
    print("throughput: " + ", ".join(f"{k[:-6]} {v}/s" for k, v in tp.items()))
    load = report["load"]
    print(f"load: consumer claimed {load['claimed']}, completed {load['completed']} "
          f"(refused {dict(load['complete_refused'])}); producer offered {load['offered']}, "
          f"acked {load['acked']} (offered again {load['offered_again']}); writer upserted "
          f"{load['upserted']}, deleted {load['deleted']}; call errors {dict(load['errors'])}")
    q = report["quiescence"]
    print(f"quiescence: {'reached' if q['reached'] else 'NOT reached'} in {q['waited_s']} s")
    ledger = report["ledger"]
    width = max(len(k) for k in LEDGER_ORDER)
    print("ledger at quiescence:")
    for name in LEDGER_ORDER:
        if name in ledger:
            print(f"  {name:<{width}}  {ledger[name]}")
    print("  routed = finished + expired + released + in_flight; "
          "finished = acknowledged + discarded + awaiting_ack")
    print(f"balanced: {'true' if ledger.get('balanced') else 'FALSE'}")
    for line in report["problems"]:
        print(f"problem: {line}")
    print(("SOAK PASSED" if report["ok"] else "SOAK FAILED")
          + f": data and logs in {report['data_dir']}, results in {report['out']}")


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:+.2f}"
