"""python -m bench: every figure of issue 16, measured in one run.

    python -m bench                      # the quick suite: small sizes, a few minutes
    python -m bench --full               # the issue's sizes (about an hour)
    python -m bench --only cycle micro   # some steps (--list names them)
    python -m bench --report DIR/results.json   # the report again, from a results file

Each step runs one bench script of bench/ as a subprocess with its ``--json``
option (the micro benchmarks: ``pytest bench/micro --benchmark-json``), and
folds what it wrote into one results file: one record a figure with its
name, value, unit, setup, the command that measured it and the machine. A
step or a peer that cannot run is reported as not run, with why, never
dropped. The folder (``--out``, by default ``bench/results/<date>-<commit>/``)
gets results.json, report.md and the plots (*.png), and each step's output
under logs/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402 - after the path fix above
from bench.suite import NOT_MEASURED, QUICK_SKIPS, STEPS, Step, fig, keeper_memory  # noqa: E402


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine the figures were taken on."""
    import psutil

    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_bytes": psutil.virtual_memory().total,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": commit,
        "git_dirty": dirty,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
    }


def command_of(step: Step, full: bool, json_path: Path) -> tuple[list[str], dict[str, str], str]:
    """(argv, extra environment, the command as a person would type it)."""
    sizes = step.full if full else step.quick
    argv = [sys.executable, *step.argv, *sizes, step.json_flag, str(json_path)]
    env = {name: values[1 if full else 0] for name, values in step.env.items()}
    shown = " ".join(f"{k}={v}" for k, v in env.items())
    try:
        where = json_path.relative_to(ROOT)
    except ValueError:
        where = json_path
    line = shlex.join(["python", *step.argv, *sizes, step.json_flag, str(where)])
    return argv, env, f"{shown} {line}".strip()


def run_step(step: Step, full: bool, out: Path) -> tuple[list[dict], dict[str, Any]]:
    """Runs one step; its figures (each with its command) and what happened."""
    raw = out / "raw" / f"{step.name}.json"
    log = out / "logs" / f"{step.name}.log"
    raw.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    argv, extra_env, command = command_of(step, full, raw)
    env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    timeout_s = step.timeout_s[1 if full else 0]
    print(f"[bench] {step.name}: {command}", flush=True)
    t0 = time.monotonic()
    rc: int | None
    with open(log, "w") as sink:
        try:
            rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                timeout=timeout_s).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.monotonic() - t0
    info = {"step": step.name, "command": command, "seconds": round(seconds, 1), "rc": rc,
            "log": str(log.relative_to(out))}  # fmt: skip
    sizes = step.full if full else step.quick
    setup = {"suite": "full" if full else "quick", "args": " ".join(sizes)}
    try:
        loaded = json.loads(raw.read_text())
        docs = loaded if isinstance(loaded, list) else [loaded]
        figures = step.figures(docs, setup)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = f"timed out after {timeout_s:.0f} s" if rc is None else f"exit {rc}"
        tail = _tail(log)
        info["error"] = f"{why}: {type(exc).__name__}: {exc}; {tail}"
        figures = [fig(f"{step.name}", None, "", setup, not_run=info["error"][:300])]
    if rc not in (0, None) and figures and "error" not in info:
        info["error"] = f"exit {rc}: {_tail(log)}"
    for f in figures:
        f["command"] = command
        f.setdefault("step", step.name)
    status = "ok" if "error" not in info else f"PROBLEM ({info['error'][:120]})"
    print(f"[bench] {step.name}: {len(figures)} figures, {seconds:.0f} s, {status}", flush=True)
    return figures, info


def _tail(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else "no output"


def default_out() -> Path:
    commit = (_git("rev-parse", "--short", "HEAD") or "nogit")[:9]
    return ROOT / "bench" / "results" / f"{time.strftime('%Y%m%d-%H%M%S')}-{commit}"


def run_suite(steps: list[Step], full: bool, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    where = machine()
    started = time.time()
    figures: list[dict] = []
    infos = []
    for step in steps:
        got, info = run_step(step, full, out)
        figures += got
        infos.append(info)
    figures += keeper_memory(figures)
    figures += [dict(f, command=None, step=None) for f in NOT_MEASURED]
    for f in figures:
        f["machine"] = where
    return {
        "suite": "full" if full else "quick",
        "machine": where,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "steps": infos,
        "figures": figures,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes, a few minutes (default)")
    size.add_argument("--full", action="store_true", help="the issue's sizes")
    p.add_argument("--out", type=Path, default=None, help="the results folder")
    p.add_argument("--only", nargs="+", default=None, metavar="STEP", help="run these steps")
    p.add_argument("--skip", nargs="+", default=[], metavar="STEP", help="leave these out")
    p.add_argument("--list", action="store_true", help="name the steps and their commands")
    p.add_argument("--report", type=Path, default=None, metavar="RESULTS_JSON",
                   help="write the report again from a results file, run nothing")  # fmt: skip
    args = p.parse_args(argv)
    names = {s.name for s in STEPS}
    unknown = (set(args.only or []) | set(args.skip)) - names
    if unknown:
        p.error(f"unknown steps {sorted(unknown)}; the steps: {', '.join(sorted(names))}")
    if args.report is not None:
        results = json.loads(args.report.read_text())
        written = report.write_report(results, args.out or args.report.parent)
        print(f"[bench] report -> {written}")
        return 0
    steps = [s for s in STEPS if (args.only is None or s.name in args.only)]
    steps = [s for s in steps if s.name not in args.skip]
    if not args.full:
        steps = [s for s in steps if s.name not in QUICK_SKIPS]
    out = args.out or default_out()
    if args.list:
        for s in steps:
            print(f"{s.name:22} {command_of(s, args.full, out / 'raw' / f'{s.name}.json')[2]}")
        return 0
    results = run_suite(steps, args.full, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    written = report.write_report(results, out)
    problems = [i for i in results["steps"] if "error" in i]
    print(f"[bench] {len(results['figures'])} figures in {results['seconds']:.0f} s -> "
          f"{out / 'results.json'}, {written}")  # fmt: skip
    for info in problems:
        print(f"[bench] {info['step']}: {info['error'][:300]}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
