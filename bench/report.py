"""The report of ``python -m bench``: markdown tables and PNG plots (matplotlib)
from a results file (bench/__main__.py writes it; bench/suite.py says what a
figure is).

    python -m bench --report bench/results/<run>/results.json

``write_report(results, folder)`` writes ``report.md`` and the plots beside
it: ``peers_cycle.png`` and ``peers_claims.png`` (the node against
PostgreSQL and Redis), ``targets.png`` (each figure with a target, as a share
of it) and one ``<group>.png`` a group of figures.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Groups in the report's order; any other group follows them.
GROUPS = {
    "cycle": "The whole cycle (claim, complete, deliver, ack), the node and its peers",
    "claims": "Claims alone, the node and its peers",
    "complete_http": "HTTP completions, one a request or batched",
    "ledger": "The ledger's completions over IPC",
    "keeper": "The keeper",
    "completion": "The completion log: group commit (fsync) and recovery",
    "delivery": "Delivery: a poll against the backlog",
    "store": "The schedule's writes: synchronous NORMAL against FULL",
    "micro": "Micro benchmarks (pytest-benchmark), the time of one operation",
    "churn": "The churned run",
    "model": "The cycle with a real model",
}
# (group, the value a peer bar shows, variants in order)
PEER_PLOTS = (
    ("cycle", "acked_per_s", ("node_local", "node_http", "postgres", "redis")),
    ("claims", "grants_per_s",
     ("node_local", "node_http", "postgres_skip_locked", "pgqueuer", "redis_lua")),
)  # fmt: skip


def _fmt(value: Any) -> str:
    if value is None:
        return "not run"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def _setup(setup: dict) -> str:
    shown = {k: v for k, v in setup.items() if k not in ("suite", "args", "machine")}
    return ", ".join(f"{k} {_fmt(v) if not isinstance(v, str) else v}" for k, v in shown.items())


def met(f: dict) -> bool | None:
    """Whether a figure meets its target (None: no target, or not measured)."""
    target, value = f.get("target"), f.get("value")
    if target is None or not isinstance(value, int | float) or isinstance(value, bool):
        return None
    return value <= target if f.get("better") == "lower" else value >= target


def share_of_target(f: dict) -> float | None:
    """How far a figure is from its target, 1 = on it, more = better than it."""
    target, value = f.get("target"), f.get("value")
    if met(f) is None or target is None:
        return None
    if f.get("better") == "lower":
        return target / value if value else float("inf")
    return value / target if target else float("inf")


def group_of(name: str) -> str:
    return name.split(".", 1)[0]


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return lines


def _peer_values(figures: list[dict], group: str, field: str) -> dict[tuple[str, int], Any]:
    out: dict[tuple[str, int], Any] = {}
    for f in figures:
        parts = f["name"].split(".")
        if len(parts) == 4 and parts[0] == group and parts[3] == field:
            batch = int(parts[2].removeprefix("batch"))
            out[(parts[1], batch)] = f["value"] if f["value"] is not None else f.get("not_run")
    return out


def _peers_section(figures: list[dict], group: str, field: str, variants: tuple) -> list[str]:
    values = _peer_values(figures, group, field)
    if not values:
        return []
    batches = sorted({b for _, b in values})
    present = [v for v in variants if any((v, b) in values for b in batches)]
    rows = []
    for b in batches:
        row = [b]
        for v in present:
            got = values.get((v, b))
            row.append(_fmt(got) if not isinstance(got, str) else f"not run: {got[:60]}")
        rows.append(row)
    lines = [f"{field.replace('_per_s', '/s').replace('_', ' ')}, by batch:", ""]
    lines += _table(["batch", *present], rows)
    ratios = [f for f in figures if f["name"].startswith(f"{group}.ratio.")]
    if ratios:
        lines += ["", "Ratios (the node over each peer):", ""]
        lines += _table(
            ["ratio", "x", "target"],
            [
                (f["name"].removeprefix(f"{group}.ratio."), _fmt(f["value"]), _target_cell(f))
                for f in ratios
            ],  # fmt: skip
        )
    return lines


def _target_cell(f: dict) -> str:
    if f.get("target") is None:
        return ""
    sign = "≤" if f.get("better") == "lower" else "≥"
    ok = met(f)
    mark = "" if ok is None else (" ok" if ok else " MISS")
    return f"{sign} {_fmt(f['target'])}{mark}"


def markdown(results: dict, plots: dict[str, str]) -> str:
    figures = results["figures"]
    m = results.get("machine", {})
    mem = m.get("memory_bytes")
    lines = [
        f"# Bench report: the {results.get('suite', '?')} suite",
        "",
        f"Taken {m.get('date', '?')} on {m.get('cpu_model', '?')}, {m.get('cores', '?')} cores, "
        + (f"{mem / 2**30:.0f} GiB memory, " if mem else "")
        + f"Python {m.get('python', '?')}, commit {str(m.get('git_commit'))[:10]}"
        + (" (with uncommitted changes)" if m.get("git_dirty") else "")
        + f"; load average {m.get('loadavg_1m_at_start', '?')} at the start; "
        f"{results.get('seconds', '?')} s in all. One run of each figure: on a shared "
        "machine single figures move by 20-50 %; compare ratios taken in the same run.",
        "",
    ]
    with_target = [f for f in figures if f.get("target") is not None]
    if with_target:
        lines += ["## Against the targets", ""]
        lines += _table(
            ["figure", "value", "unit", "target"],
            [(f["name"], _fmt(f["value"]), f["unit"], _target_cell(f)) for f in with_target],
        )
        if "targets" in plots:
            lines += ["", f"![the figures as a share of their targets]({plots['targets']})"]
        lines.append("")
    groups = list(GROUPS) + sorted({group_of(f["name"]) for f in figures} - set(GROUPS))
    for group in groups:
        mine = [f for f in figures if group_of(f["name"]) == group]
        if not mine:
            continue
        lines += [f"## {GROUPS.get(group, group)}", ""]
        for peer_group, field, variants in PEER_PLOTS:
            if peer_group == group:
                lines += _peers_section(figures, group, field, variants)
                lines.append("")
                if f"peers_{group}" in plots:
                    lines += [f"![{group}: the node and its peers]({plots[f'peers_{group}']})", ""]
        lines += _table(
            ["figure", "value", "unit", "setup"],
            [(f["name"], _fmt(f["value"]) if f["value"] is not None
              else f"not run: {f.get('not_run', '')}", f["unit"], _setup(f.get("setup", {})))
             for f in mine],
        )  # fmt: skip
        if group in plots:
            lines += ["", f"![{group}]({plots[group]})"]
        commands = sorted({f["command"] for f in mine if f.get("command")})
        if commands:
            lines += ["", "Measured by:", "", "```sh", *commands, "```"]
        lines.append("")
    steps = results.get("steps", [])
    if steps:
        lines += ["## The steps", ""]
        lines += _table(
            ["step", "seconds", "exit", "problem"],
            [(s["step"], s["seconds"], s["rc"], s.get("error", "")[:160]) for s in steps],
        )
        lines.append("")
    return "\n".join(lines)


# -- the plots ------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_peers(figures: list[dict], group: str, field: str, variants: tuple, path: Path) -> bool:
    values = _peer_values(figures, group, field)
    batches = sorted({b for _, b in values})
    present = [v for v in variants if any((v, b) in values for b in batches)]
    if not present:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(present)
    for i, variant in enumerate(present):
        heights = []
        for b in batches:
            got = values.get((variant, b))
            heights.append(got if isinstance(got, int | float) and got > 0 else 0)
        label = variant
        if any(isinstance(values.get((variant, b)), str) for b in batches):
            label += " (not run)"
        xs = [j + (i - (len(present) - 1) / 2) * width for j in range(len(batches))]
        bars = ax.bar(xs, heights, width, label=label)
        ax.bar_label(bars, labels=[_fmt(h) if h else "not run" for h in heights], fontsize=7)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_yscale("log")
    ax.set_ylabel(field.replace("_per_s", "/s").replace("_", " "))
    ax.set_title(f"{group}: {field.replace('_', ' ')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_targets(figures: list[dict], path: Path) -> bool:
    shown = [(f["name"], share_of_target(f)) for f in figures]
    shown = [(n, s) for n, s in shown if s is not None and s != float("inf")]
    if not shown:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(shown) + 1.2))
    names = [n for n, _ in shown]
    shares = [s for _, s in shown]
    colours = ["tab:green" if s >= 1 else "tab:red" for s in shares]
    ax.barh(range(len(shown)), shares, color=colours)
    ax.set_yticks(range(len(shown)), names, fontsize=7)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("share of the target (1 = on it; right of the line meets it)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_group(figures: list[dict], group: str, path: Path) -> bool:
    """A group's figures as horizontal bars, one panel a unit."""
    by_unit: dict[str, list[dict]] = {}
    for f in figures:
        value = f.get("value")
        if group_of(f["name"]) == group and isinstance(value, int | float):
            if not isinstance(value, bool) and value > 0 and f["unit"] not in ("x", "bool"):
                by_unit.setdefault(f["unit"], []).append(f)
    if not by_unit:
        return False
    plt = _pyplot()
    units = sorted(by_unit)
    heights = [0.3 * len(by_unit[u]) + 0.9 for u in units]
    fig, axes = plt.subplots(len(units), 1, figsize=(9, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})  # fmt: skip
    for ax, unit in zip(axes[:, 0], units, strict=True):
        mine = by_unit[unit]
        values = [f["value"] for f in mine]
        ax.barh(range(len(mine)), values, color="tab:blue")
        ax.set_yticks(range(len(mine)), [f["name"].split(".", 1)[1] for f in mine], fontsize=7)
        for f, y in zip(mine, range(len(mine)), strict=True):
            if f.get("target") is not None:
                ax.plot([f["target"]], [y], marker="|", color="red", markersize=12)
        if max(values) / min(values) > 100:
            ax.set_xscale("log")
        ax.set_xlabel(unit + "   (red mark: the target)")
        ax.invert_yaxis()
    fig.suptitle(GROUPS.get(group, group), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(results: dict, folder: Path) -> dict[str, str]:
    """The PNGs; {what: file name}."""
    figures = results["figures"]
    plots: dict[str, str] = {}
    for group, field, variants in PEER_PLOTS:
        name = f"peers_{group}.png"
        if _plot_peers(figures, group, field, variants, folder / name):
            plots[f"peers_{group}"] = name
    if _plot_targets(figures, folder / "targets.png"):
        plots["targets"] = "targets.png"
    for group in sorted({group_of(f["name"]) for f in figures}):
        if _plot_group(figures, group, folder / f"{group}.png"):
            plots[group] = f"{group}.png"
    return plots


def write_report(results: dict, folder: Path) -> Path:
    """report.md and the plots into ``folder``; the report's path."""
    folder.mkdir(parents=True, exist_ok=True)
    plots = write_plots(results, folder)
    path = folder / "report.md"
    path.write_text(markdown(results, plots) + "\n")
    return path
