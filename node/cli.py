"""The command line: ``python -m node [run|demo|state|import|clear|migrate] …``.

Errors a user can act on are one line on stderr and exit 2; ``-v`` keeps the
traceback. Exit codes have names in ``node.core.proc``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence

from node.core.errors import ConfigError, NodeError, NodeNotRunning
from node.core.proc import RET_ERROR, RET_NO_NODE, RET_NOT_VOUCHED, RET_OK, RET_USAGE

# --watch looks for a new document this often; the keeper writes one every
# state_interval_s (5 s by default), and one is printed as soon as it lands.
WATCH_POLL_S = 0.1
# With no new document for this long (a stalled keeper writes none), the
# state is printed anyway: it says the keeper no longer vouches, and why.
WATCH_QUIET_S = 5.0


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


_MIGRATE_HELP = """\
Move one node's schedule out of its SQLite file into a fleet's PostgreSQL
database (docs/postgres.md, "Moving a node's schedule into a fleet").

Every row is copied column for column except its version (the target's
triggers give each row its own, as for any insert); the node's meta
(lifetime counters, paused routes and node) goes to the node's name in the
target (--name; else the name of the data directory's last run on this file;
else the host's node name). One transaction: it is all copied, counted and
checked (a checksum of every column but the payload, read back) or nothing
is. The source file is only read. Progress on stderr; a one-line JSON
summary on stdout.

Refused, with one line and exit 2, nothing written: --from not a sqlite:///
file that is there; --to not postgresql://; a target holding rows (without
--merge) or any of the source's keys (with it) or meta of the node's name; a
node running on the source (node.json in its data directory, or a node of
its name on this host), or any write to it during the copy. Exit 1: the
database failed, or read back other rows (nothing committed either).

A password in --to is moved to PGPASSWORD at once and never printed; better,
leave it out and set PGPASSWORD or ~/.pgpass.
"""


def _migrate_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser(
        "migrate",
        help="move a node's SQLite schedule into a fleet's PostgreSQL database",
        description=_MIGRATE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="sqlite:///FILE",
        help="the node's store (stopped)",
    )
    m.add_argument(
        "--to",
        dest="target",
        required=True,
        metavar="postgresql://USER@HOST/DB",
        help="the fleet's database",
    )
    m.add_argument("--name", help="whose meta it is in the target (see above)")
    m.add_argument(
        "--data-dir",
        dest="data_dir",
        help="the node's data directory (default: the file's directory)",
    )
    m.add_argument(
        "--merge",
        action="store_true",
        help="allow a target with other nodes' rows (never the same key)",
    )
    m.add_argument("--progress-s", dest="progress_s", type=float, help=argparse.SUPPRESS)
    m.add_argument("-v", "--verbose", action="store_true")


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
    s.add_argument(
        "--scope", choices=["cluster"],
        help="cluster: every live node of the fleet summed, asked of this node over HTTP",
    )  # fmt: skip
    s.add_argument("--token", help="with --scope cluster: the fleet's token (QUEUE_NODE_TOKEN)")
    s.add_argument("--url", help="with --scope cluster: the node's base URL (default: its address)")
    s.add_argument("--interval", type=float, default=WATCH_POLL_S, help=argparse.SUPPRESS)
    sub.add_parser("import", help="import rows from JSON lines, CSV or a sitemap", add_help=False)
    c = sub.add_parser("clear", help="remove a stopped node's shared memory, semaphore and queues")
    c.add_argument("name", help="the node's name")
    _migrate_parser(sub)
    f = sub.add_parser(
        "forget",
        help="delete a fleet node that left or lapsed from the node list, freeing its number",
        description=_FORGET_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    f.add_argument("name", help="the node's name, as the node list shows it")
    f.add_argument("--store", help="the fleet's database (postgresql://…)")
    f.add_argument("--config", help="a node's configuration file (its store, its timeout)")
    return parser


_FORGET_HELP = """\
Delete a node that is no member (it left, or its last heartbeat is older
than membership_timeout_s by the database's clock) from the fleet's node
list, freeing its number (1-255) for a node that joins later. A live node is
refused, exit 2, and nothing changes.

Forget only a node that will not come back with its data directory (a host
gone for good), or whose results are all acknowledged: its results' ids
carry its number, and once it is freed no node answers for them (an ack of
one is refused, 409). The timeout is the configuration's
(membership_timeout_s, default 10 s): give the fleet's own with --config or
QUEUE_NODE_MEMBERSHIP_TIMEOUT_S.
"""


_RUN_OPTIONS = (
    "store",
    "data_dir",
    "name",
    "http",
    "workers",
    "handler",
    "inference_procs",
    "gpus",
    "lease_s",
    "ready_size",
    "token",
    "tls_cert",
    "tls_key",
)


def _cmd_run(args: argparse.Namespace) -> int:
    import dataclasses

    from node.core.config import load_config
    from node.core.urls import split_password
    from node.supervisor import run

    if args.store:
        _hide_store_password(args.store)
    flags = {name: getattr(args, name, None) for name in _RUN_OPTIONS}
    config = load_config(flags, config_file=getattr(args, "config", None))
    # A password in the store URL (the file, the environment) goes to libpq
    # by PGPASSWORD, inherited by every child; the configuration the node
    # writes and logs, and hands its children, keeps the bare URL.
    bare, password = split_password(config.store)
    if password is not None:
        os.environ["PGPASSWORD"] = password
        config = dataclasses.replace(config, store=bare)
    return run(config, verbose=args.verbose)


def _hide_store_password(store: str) -> None:
    """A password given in ``--store`` is on the command line, which ``ps``
    shows to every user: move it to PGPASSWORD and start again with the bare
    URL (the process's arguments cannot be rewritten in place from Python)."""
    from node.core.urls import split_password

    bare, password = split_password(store)
    if password is None:
        return
    os.environ["PGPASSWORD"] = password
    argv = [arg.replace(store, bare) for arg in sys.argv[1:]]
    os.execv(sys.executable, [sys.executable, "-m", "node", *argv])


def _state_name(name: str | None) -> str:
    from node.core.config import ENV_PREFIX
    from node.core.names import check_name, host_node_name

    return check_name(name or os.environ.get(ENV_PREFIX + "NAME") or host_node_name())


def _cmd_state(args: argparse.Namespace) -> int:
    """Print the queue state once: exit 0 when the keeper vouches, 3 when it
    does not, 4 when no node of that name runs here. ``--watch``: again at
    every new document until Ctrl-C or SIGTERM (exit 0)."""
    from shm.state import read_state

    name = _state_name(args.name)
    if args.scope and args.watch:
        raise ConfigError("--watch follows this node's state buffer; it takes no --scope")
    try:
        state = read_state(name)
    except NodeNotRunning as exc:
        print(f"node state: {exc}", file=sys.stderr)
        return RET_NO_NODE
    if args.scope:
        cluster = _cluster_state(name, state, args.url, args.token)
        if cluster is None:
            return RET_NO_NODE
        state = cluster
    if args.watch:
        return _watch_state(name, state, max(0.01, args.interval))
    print(json.dumps(state, sort_keys=True), flush=True)
    return RET_OK if state["trust"]["vouched"] else RET_NOT_VOUCHED


def _cluster_state(name: str, state: dict, url: str | None, token: str | None) -> dict | None:
    """``--scope cluster``: a node outside a fleet is a fleet of one (its own
    state); a fleet node is asked over HTTP (``GET /queue-state?scope=
    cluster``, the fan-out is the node's), at the address its keeper joined
    the node list with. None (said on stderr): the node did not answer."""
    from node.client import Client, ClientError
    from node.core.config import ENV_PREFIX

    membership = state["trust"].get("membership")
    if not membership and url is None:
        return {**state, "scope": "cluster", "nodes": [name]}
    address = "" if membership is None else str(membership.get("address") or "")
    base = url or (address if address.startswith("unix:") else f"http://{address}")
    try:
        client = Client(base, token=token or os.environ.get(ENV_PREFIX + "TOKEN"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return client.queue_state(scope="cluster")
    except ClientError as exc:
        print(f"node state: {base} answered {exc}", file=sys.stderr)
        return None


def _watch_state(name: str, state: dict, poll_s: float) -> int:
    """One JSON document per line: the state at every new document of the
    keeper (every state interval), until SIGINT or SIGTERM (exit 0); exit 4
    when the node goes away meanwhile."""
    import signal
    import threading

    from shm.state import read_state

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()  # only the flag: the loop below does the stopping

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            print(json.dumps(state, sort_keys=True), flush=True)
            printed_at, counts_at = time.monotonic(), state["trust"].get("counts_at")
            while not stop.wait(poll_s):
                try:
                    state = read_state(name)
                except NodeNotRunning as exc:
                    print(f"node state: {exc}", file=sys.stderr)
                    return RET_NO_NODE
                quiet_s = time.monotonic() - printed_at
                if state["trust"].get("counts_at") != counts_at or quiet_s >= WATCH_QUIET_S:
                    break
            if stop.is_set():
                return RET_OK
    except BrokenPipeError:
        # The reader went away (| head): nothing more to say, and nothing to
        # flush at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return RET_OK
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _cmd_clear(args: argparse.Namespace) -> int:
    """Remove a node's host-wide names when no process holds them: the way
    out of a start refused for a stale or foreign name. Exit 0 (what was
    removed, one line each), 2 when they are in use or not this user's."""
    from node.core.names import check_name
    from node.names import clear

    removed = clear(check_name(args.name))
    for name in removed:
        print(f"removed {name}")
    if not removed:
        print(f"nothing of node {args.name!r} to remove")
    return RET_OK


def _cmd_migrate(args: argparse.Namespace) -> int:
    from node.migrate import main as migrate_main

    _hide_store_password(args.target)
    return migrate_main(args)


def _cmd_forget(args: argparse.Namespace) -> int:
    """Forget a node that left or lapsed: one JSON line, exit 0; exit 2 with
    one line for a live node, a name not on the list, or no fleet database."""
    from node.core.config import load_config
    from node.core.names import check_name
    from node.fleet.membership import Membership

    name = check_name(args.name)
    if args.store:
        _hide_store_password(args.store)
    config = load_config({"store": args.store}, config_file=args.config)
    if not config.store.startswith(("postgresql://", "postgres://")):
        given = f"the store is {config.store}" if config.store else "no store is given"
        raise ConfigError(f"forget needs the fleet's database, --store postgresql://… (or "
                          f"--config with one): {given}, and only a fleet has a node list")
    membership = Membership(config.store, "forget", "",
                            membership_timeout_s=config.membership_timeout_s)  # fmt: skip
    try:
        live, absent = membership.listing()
        gone = {a.member.name: a for a in absent}
        if name in live:
            raise NodeError(f"node {name!r} is live (a heartbeat within "
                            f"{config.membership_timeout_s:g} s): stop it first, or wait "
                            "until it lapses")  # fmt: skip
        if name not in gone:
            raise NodeError(f"node {name!r} is not on the fleet's node list")
        if not membership.forget(name):
            raise NodeError(f"node {name!r} sent a heartbeat meanwhile: it is live, not forgotten")
    finally:
        membership.close()
    member, left_at = gone[name].member, gone[name].left_at
    print(json.dumps({"forgotten": name, "number": member.number, "address": member.address,
                      "left": left_at is not None}))  # fmt: skip
    return RET_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from node.demo import main as demo_main

    return demo_main(args)


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "state": _cmd_state,
    "demo": _cmd_demo,
    "clear": _cmd_clear,
    "migrate": _cmd_migrate,
    "forget": _cmd_forget,
}


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
        command = _COMMANDS.get(args.command)
        if command is not None:
            return command(args)
    except (ConfigError, NodeError) as exc:
        if verbose:  # the traceback, then the same line and status as without -v
            traceback.print_exc()
        print(f"node: {_one_line(exc)}", file=sys.stderr)
        return RET_USAGE
    except KeyboardInterrupt:
        return RET_OK
    return RET_ERROR


def _one_line(exc: BaseException) -> str:
    """The chain of causes on one line: each message's lines joined (a
    driver's message may carry hints on lines of their own), and a cause
    whose first line its effect already says left out."""
    parts: list[str] = []
    cause: BaseException | None = exc
    while cause is not None and len(parts) < 3:
        text = " ".join(str(cause).split())
        first = str(cause).strip().splitlines()[0] if text else ""
        if text and not any(first in p for p in parts):
            parts.append(text)
        cause = cause.__cause__
    return ": ".join(parts)
