"""The command line: ``python -m node [run|demo|state|import] …``.

Errors a user can act on are one line on stderr and exit 2; ``-v`` keeps the
traceback. Exit codes have names in ``node.proc``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from node.errors import ConfigError, NodeError, NodeNotRunning
from node.proc import RET_ERROR, RET_NO_NODE, RET_NOT_VOUCHED, RET_OK, RET_USAGE


class _Parser(argparse.ArgumentParser):
    """argparse that says what is wrong in one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: {message}\n")
        raise SystemExit(RET_USAGE)


def _run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the node (the default)")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--store", help="sqlite:///FILE (default: <data-dir>/schedule.db)")
    p.add_argument("--data-dir", dest="data_dir")
    p.add_argument("--name")
    p.add_argument("--http", help="HOST:PORT (port 0 picks a free one)")
    p.add_argument("--workers")
    p.add_argument("--handler", help="MODULE:CALLABLE")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--inference-procs", dest="inference_procs")
    group.add_argument("--gpus", help="0,1,…")
    p.add_argument("--lease-s", dest="lease_s")
    p.add_argument("--ready-size", dest="ready_size")
    p.add_argument("--token")
    p.add_argument("--tls-cert", dest="tls_cert")
    p.add_argument("--tls-key", dest="tls_key")
    p.add_argument("-v", "--verbose", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m node", description="queue-node")
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    _run_parser(sub)
    d = sub.add_parser("demo", help="seed a schedule and run it with a CPU handler")
    d.add_argument("--rows", type=int, default=20_000)
    d.add_argument("--data-dir", dest="data_dir")
    s = sub.add_parser("state", help="print the shared state buffer as JSON")
    s.add_argument("--name")
    s.add_argument("--watch", action="store_true")
    s.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
    sub.add_parser("import", help="import rows from JSON lines, CSV or a sitemap", add_help=False)
    return parser


_RUN_OPTIONS = (
    "store", "data_dir", "name", "http", "workers", "handler", "inference_procs",
    "gpus", "lease_s", "ready_size", "token", "tls_cert", "tls_key",
)


def _cmd_run(args: argparse.Namespace) -> int:
    from node.config import load_config
    from node.supervisor import run

    flags = {name: getattr(args, name, None) for name in _RUN_OPTIONS}
    config = load_config(flags, config_file=getattr(args, "config", None))
    return run(config, verbose=args.verbose)


def _state_name(name: str | None) -> str:
    from node.config import _clean_host_name, check_name

    return check_name(name or os.environ.get("QUEUE_NODE_NAME") or _clean_host_name())


def _cmd_state(args: argparse.Namespace) -> int:
    from shm.state import read_state

    name = _state_name(args.name)
    while True:
        try:
            state = read_state(name)
        except NodeNotRunning as exc:
            print(f"node state: {exc}", file=sys.stderr)
            if not args.watch:
                return RET_NO_NODE
            state = None
        if state is not None:
            print(json.dumps(state, sort_keys=True), flush=True)
        if not args.watch:
            return RET_OK if state["trust"]["vouched"] else RET_NOT_VOUCHED
        time.sleep(max(0.1, args.interval))  # a display refresh, not synchronisation


def _cmd_demo(args: argparse.Namespace) -> int:
    from node.demo import main as demo_main

    return demo_main(args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "-v" in argv or "--verbose" in argv
    if argv and argv[0] == "import":
        from node.importer import main as import_main

        return import_main(argv[1:])
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "-v", "--verbose"):
        argv = ["run", *argv]
    if argv in (["-v"], ["--verbose"]):
        argv = ["run", *argv]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command in (None, "run"):
            if args.command is None:
                args = parser.parse_args(["run", *argv])
            return _cmd_run(args)
        if args.command == "state":
            return _cmd_state(args)
        if args.command == "demo":
            return _cmd_demo(args)
    except (ConfigError, NodeError) as exc:
        if verbose:
            raise
        print(f"node: {_one_line(exc)}", file=sys.stderr)
        return RET_USAGE
    except KeyboardInterrupt:
        return RET_OK
    return RET_ERROR


def _one_line(exc: BaseException) -> str:
    """The chain of causes on one line."""
    parts = [str(exc)]
    cause = exc.__cause__
    while cause is not None and len(parts) < 3:
        parts.append(str(cause))
        cause = cause.__cause__
    return ": ".join(p for p in parts if p)
