"""``scripts/fleet``: a fleet of N nodes on this host, over one PostgreSQL
database, started, stopped and looked at as one.

    scripts/fleet start N [--db URL] [--dir DIR] [--base-port P] [--prefix NAME] [NODE RUN ARGS…]
    scripts/fleet stop    [--dir DIR]
    scripts/fleet status  [--dir DIR] [--json] [--token TOKEN]

Each node is ``python -m node run --store URL --data-dir DIR/NAME --name NAME
--http 127.0.0.1:PORT`` plus the arguments this script does not know, named
``PREFIX-1`` … ``PREFIX-N`` (``fleet-1`` …), on ports ``P`` … ``P+N-1``
(``--base-port 0``: each picks a free one), each naming the others as its
``peers`` (``QUEUE_NODE_PEERS``) so that none grants alone before the others
are there (docs/fleet.md, "Waiting for peers"). Every other setting comes
from the environment as for any node (``QUEUE_NODE_MEMBERSHIP_TIMEOUT_S``…).

Who owns what: ``DIR/fleet.json`` is this script's record of the nodes it
started (name, data directory, supervisor pid and that process's start time,
so a reused pid is never taken for a node); it is written at ``start`` and
kept by ``stop``, so ``status`` still lists a stopped fleet. Each node's
``DIR/NAME/node.json`` is the node's own (its address, written once it
listens, removed at a clean stop); this script only reads it. ``stop``
signals, waits and removes nothing: the data directories and the database
are durable, and a later ``start`` runs the same nodes on them again.

Operators' page: docs/fleet.md, "Running a fleet on one host".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from node.client import Client
from node.core.errors import ClientError, ConfigError, NodeError, StoreUnavailable
from node.core.names import check_name
from node.core.proc import RET_ERROR, RET_NO_NODE, RET_NOT_VOUCHED, RET_OK, RET_USAGE
from node.core.urls import redact_url, split_password

PROG = "scripts/fleet"
DEFAULT_DB = "postgresql://postgres@127.0.0.1:5432/queue_node_fleet"
DEFAULT_DIR = Path("fleet-data")
# fleet-1 on 8471: 8470 is a single node's default (scripts/run), left free.
DEFAULT_BASE_PORT = 8471
DEFAULT_PREFIX = "fleet"
RECORD = "fleet.json"
# Long enough for a node's load, its wait for a peer and the handover hold
# of a joining node (one membership_timeout_s, 10 s by default:
# docs/delivery.md, "Two nodes, one key"), with room on a busy host.
START_WAIT_S = 90.0
# A node's drain on SIGTERM takes up to drain_timeout_s (30 s by default).
STOP_WAIT_S = 45.0
# One HTTP request of a readiness poll or of status: a node that does not
# answer in this long is shown as not answering.
REQUEST_TIMEOUT_S = 3.0
POLL_MAX_S = 0.2
# How much of a node's log a failure shows.
LOG_TAIL_LINES = 20
# The options this script sets on each node itself.
OWN_OPTIONS = ("--store", "--data-dir", "--name", "--http")
HELP = ("-h", "--help")


class FleetRunning(ConfigError):
    """``start`` found a node of that directory running already."""


class NoFleet(NodeError):
    """The directory holds no ``fleet.json``: no fleet was started from it."""


@dataclass
class Member:
    """One node of the fleet as ``fleet.json`` records it."""

    name: str
    data_dir: str
    http: str  # what it was told to bind; node.json says what it bound
    pid: int
    create_time: float  # psutil's, of the supervisor: a reused pid differs

    def alive(self) -> bool:
        return _alive(self.pid, self.create_time)

    def node_json(self) -> dict[str, Any]:
        """The node's own ``node.json``, or {} before it listens / after it stopped."""
        try:
            doc = json.loads((Path(self.data_dir) / "node.json").read_text())
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) and doc.get("pid") == self.pid else {}

    def url(self) -> str:
        return "http://" + (self.node_json().get("http") or self.http)

    def log_tail(self) -> str:
        try:
            lines = (Path(self.data_dir) / "node.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-LOG_TAIL_LINES:])


def _alive(pid: int, create_time: float | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie), and is the process started at
    ``create_time`` when one is given."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(proc.create_time() - create_time) < 0.01
    except psutil.Error:
        return False


# -- the record ----------------------------------------------------------------------------


def read_record(fleet_dir: Path) -> tuple[str, list[Member]]:
    """(the database, the members) of ``DIR/fleet.json``; NoFleet when
    there is none."""
    path = fleet_dir / RECORD
    try:
        doc = json.loads(path.read_text())
        return doc["db"], [Member(**m) for m in doc["nodes"]]
    except FileNotFoundError:
        raise NoFleet(f"no fleet in {fleet_dir} (no {RECORD}): {PROG} start N first") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is not a fleet record: {exc}") from None


def write_record(fleet_dir: Path, db: str, members: list[Member]) -> None:
    doc = {"db": db, "started_at": time.time(), "nodes": [asdict(m) for m in members]}
    tmp = fleet_dir / (RECORD + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, fleet_dir / RECORD)


def running_nodes(fleet_dir: Path) -> list[str]:
    """``NAME (pid N)`` for each node of the directory that runs: those the
    record names, and any whose ``node.json`` names a live pid (a node
    started by hand on one of its data directories)."""
    found: dict[int, str] = {}
    try:
        _, members = read_record(fleet_dir)
    except NoFleet:
        members = []
    for m in members:
        if m.alive():
            found[m.pid] = m.name
    for path in sorted(fleet_dir.glob("*/node.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        pid = doc.get("pid") if isinstance(doc, dict) else None
        if isinstance(pid, int) and _alive(pid):
            found.setdefault(pid, str(doc.get("name") or path.parent.name))
    return [f"{name} (pid {pid})" for pid, name in found.items()]


# -- the database --------------------------------------------------------------------------


def ensure_database(url: str) -> bool:
    """Create the database ``url`` names when its server has none of that
    name (through the server's ``postgres`` database); True when created."""
    try:
        import psycopg
        from psycopg import sql
        from psycopg.conninfo import conninfo_to_dict, make_conninfo
    except ImportError:
        raise ConfigError(
            "the PostgreSQL driver is not installed: scripts/setup fleet (the fleet extra)"
        ) from None
    try:
        name = str(conninfo_to_dict(url).get("dbname") or "")
    except psycopg.Error as exc:
        raise ConfigError(f"--db {redact_url(url)} is not valid: {exc}") from None
    if not name:
        raise ConfigError(f"--db {redact_url(url)} names no database")
    try:
        psycopg.connect(url, connect_timeout=5).close()
        return False
    except psycopg.OperationalError as exc:
        first = exc
    try:
        admin = make_conninfo(url, dbname="postgres")
        with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
                raise first  # it exists: the first error was something else
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            return True
    except psycopg.errors.DuplicateDatabase:
        return False  # another start made it meanwhile
    except psycopg.Error as exc:
        raise StoreUnavailable(f"cannot open or create {redact_url(url)}: {exc}") from None


# -- start ---------------------------------------------------------------------------------


def _check_extra(extra: list[str]) -> list[str]:
    if extra[:1] == ["--"]:
        extra = extra[1:]
    for arg in extra:
        option = arg.split("=", 1)[0]
        if option in OWN_OPTIONS:
            raise ConfigError(
                f"{option} is set by {PROG} for each node: use --db, --dir, --prefix, --base-port"
            )
    return extra


def plan(args: argparse.Namespace) -> list[tuple[str, Path, str]]:
    """(name, data directory, HTTP address) of each node, checked."""
    if not 1 <= args.n <= 255:  # a fleet numbers its nodes 1 to 255 (docs/fleet.md)
        raise ConfigError(f"N = {args.n} is out of range: allowed 1 to 255")
    if args.base_port != 0 and not 1 <= args.base_port <= 65536 - args.n:
        raise ConfigError(f"--base-port {args.base_port}: N ports from it must fit below 65536")
    out = []
    for i in range(1, args.n + 1):
        name = check_name(f"{args.prefix}-{i}")
        port = 0 if args.base_port == 0 else args.base_port + i - 1
        out.append((name, (args.dir / name).resolve(), f"127.0.0.1:{port}"))
    return out


def _launch(name: str, data_dir: Path, http: str, peers: list[str], db: str,
            password: str | None, extra: list[str]) -> subprocess.Popen:  # fmt: skip
    """One node, detached: its own session (a Ctrl-C or a closed terminal
    after ``start`` does not reach it), its output appended to its log."""
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "node.json").unlink(missing_ok=True)  # a killed node's: not this one's address
    env = dict(os.environ, QUEUE_NODE_PEERS=",".join(peers))
    if password is not None:  # on the command line, ps would show it
        env["PGPASSWORD"] = password
    argv = [sys.executable, "-m", "node", "run", "--store", db, "--data-dir", str(data_dir),
            "--name", name, "--http", http, *extra]  # fmt: skip
    with open(data_dir / "node.log", "ab") as log:  # the child holds its own descriptor
        return subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def _ready(client: Client | None) -> bool:
    if client is None:
        return False
    try:
        client.request("GET", "/readyz", timeout_s=REQUEST_TIMEOUT_S)
    except ClientError:  # 503 (loading, waiting for its peers, joining), or no answer yet
        return False
    return True


def wait_ready(
    members: list[Member], procs: list[subprocess.Popen], wait_s: float
) -> tuple[Member, str] | None:
    """Poll every node's ``/readyz`` until each answers 200: None, or the
    first node that exited or was not ready by the deadline, and why."""
    deadline = time.monotonic() + wait_s
    clients: dict[str, Client] = {}
    pending = list(zip(members, procs, strict=True))
    delay = 0.01
    try:
        while pending:
            for member, proc in list(pending):
                if proc.poll() is not None:
                    return member, f"exited with status {proc.returncode}"
                bound = member.node_json().get("http")
                if member.name not in clients and bound:
                    member.http = bound  # with --base-port 0, the port it chose
                    clients[member.name] = Client(member.url(), timeout_s=REQUEST_TIMEOUT_S)
                if _ready(clients.get(member.name)):
                    pending.remove((member, proc))
            if pending and time.monotonic() >= deadline:
                member = pending[0][0]
                return member, f"not ready after {wait_s:g} s ({_reason(clients.get(member.name))})"
            time.sleep(delay)  # the polling interval of a deadline wait, not synchronisation
            delay = min(delay * 2, POLL_MAX_S)
        return None
    finally:
        for client in clients.values():
            client.close()


def _reason(client: Client | None) -> str:
    if client is None:
        return "it never wrote node.json: not listening"
    try:
        client.request("GET", "/readyz")
    except ClientError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        return f"/readyz {exc.status}: {body.get('reason') or exc.message}"
    return "ready now"


def cmd_start(args: argparse.Namespace, extra: list[str]) -> int:
    extra = _check_extra(extra)
    nodes = plan(args)
    if not args.db.startswith(("postgresql://", "postgres://")):
        raise ConfigError(f"--db {redact_url(args.db)} is not a postgresql:// URL")
    running = running_nodes(args.dir)
    if running:
        raise FleetRunning(
            f"{args.dir} has nodes running: {', '.join(running)}; {PROG} stop --dir {args.dir}"
        )
    if ensure_database(args.db):
        print(f"created the database {redact_url(args.db)}", flush=True)
    args.dir.mkdir(parents=True, exist_ok=True)
    db, password = split_password(args.db)
    names = [name for name, _, _ in nodes]
    members: list[Member] = []
    procs: list[subprocess.Popen] = []
    for name, data_dir, http in nodes:
        peers = [n for n in names if n != name]
        proc = _launch(name, data_dir, http, peers, db, password, extra)
        procs.append(proc)
        members.append(Member(name, str(data_dir), http, proc.pid, _create_time(proc.pid)))
    write_record(args.dir, db, members)
    failed = wait_ready(members, procs, args.wait_s)
    write_record(args.dir, db, members)  # with the ports bound, for status after a stop
    if failed is not None:
        member, why = failed
        print(f"{PROG}: {member.name} {why}; the end of {member.data_dir}/node.log:",
              file=sys.stderr)  # fmt: skip
        print(member.log_tail(), file=sys.stderr)
        stopped, left = stop_members(members, STOP_WAIT_S)
        still = f"; still running: {', '.join(left)}" if left else ""
        print(f"{PROG}: stopped the nodes it had started ({len(stopped)}){still}", file=sys.stderr)
        return RET_ERROR
    for member in members:
        print(f"{member.name} {member.url()}")
    return RET_OK


def _create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:  # it exited at once: wait_ready reports it
        return 0.0


# -- stop ----------------------------------------------------------------------------------


def stop_members(members: list[Member], wait_s: float) -> tuple[list[str], list[str]]:
    """SIGTERM every live member, then wait for all of them on one deadline:
    (the names that stopped, ``NAME (pid N)`` of those still running)."""
    signalled = []
    for m in members:
        if not m.alive():
            continue
        try:
            os.kill(m.pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        signalled.append(m)
    deadline = time.monotonic() + wait_s
    delay = 0.01
    while any(m.alive() for m in signalled) and time.monotonic() < deadline:
        time.sleep(delay)  # the polling interval of a deadline wait, not synchronisation
        delay = min(delay * 2, POLL_MAX_S)
    left = [f"{m.name} (pid {m.pid})" for m in signalled if m.alive()]
    return [m.name for m in signalled if not m.alive()], left


def cmd_stop(args: argparse.Namespace) -> int:
    try:
        _, members = read_record(args.dir)
    except NoFleet as exc:
        print(f"{exc}: nothing to stop")
        return RET_OK
    stopped, left = stop_members(members, args.wait_s)
    for name in stopped:
        print(f"{name} stopped")
    if left:
        print(f"{PROG}: still running after {args.wait_s:g} s: {', '.join(left)} "
              "(still draining, or stuck: kill -9 it)", file=sys.stderr)  # fmt: skip
        return RET_ERROR
    if not stopped:
        print(f"no node of {args.dir} was running")
    return RET_OK


# -- status --------------------------------------------------------------------------------


def _get(client: Client, path: str) -> tuple[int, Any]:
    """(status, document) of one GET; status 0 when nothing answers."""
    try:
        return 200, client.request("GET", path, timeout_s=REQUEST_TIMEOUT_S)
    except ClientError as exc:
        return exc.status, exc.body


def node_status(member: Member, token: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": member.name, "url": member.url(), "pid": member.pid,
                           "alive": member.alive(), "readyz": None, "due": None,
                           "in_flight": None, "vouched": None}  # fmt: skip
    if not out["alive"]:
        return out
    with Client(out["url"], token=token, timeout_s=REQUEST_TIMEOUT_S) as client:
        out["readyz"] = _get(client, "/readyz")[0] or None
        status, state = _get(client, "/queue-state")
    if status in (200, 503) and isinstance(state, dict):
        now = state.get("now") or {}
        out["due"] = (now.get("due") or {}).get("total")
        out["in_flight"] = now.get("in_flight")
        out["vouched"] = bool((state.get("trust") or {}).get("vouched"))
    return out


def cluster_status(nodes: list[dict[str, Any]], token: str | None) -> dict[str, Any] | None:
    """``GET /queue-state?scope=cluster`` of the first live node that answers."""
    for node in nodes:
        if not node["alive"]:
            continue
        with Client(node["url"], token=token, timeout_s=REQUEST_TIMEOUT_S) as client:
            status, state = _get(client, "/queue-state?scope=cluster")
        if status:
            return {"asked": node["name"], "status": status, "state": state}
    return None


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _print_table(nodes: list[dict[str, Any]]) -> None:
    columns = ("name", "url", "pid", "alive", "readyz", "due", "in_flight", "vouched")
    rows = [columns, *[tuple(_cell(n[c]) for c in columns) for n in nodes]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _cluster_line(cluster: dict[str, Any]) -> str:
    state = cluster["state"] if isinstance(cluster["state"], dict) else {}
    trust = state.get("trust") or {}
    now = state.get("now") or {}
    parts = [f"cluster (asked {cluster['asked']}): {cluster['status']}",
             f"vouched={_cell(trust.get('vouched'))}",
             f"due={_cell((now.get('due') or {}).get('total'))}",
             f"in_flight={_cell(now.get('in_flight'))}"]  # fmt: skip
    if isinstance(state.get("nodes"), list):  # names, or (a fan-out's) one object per node
        names = [n.get("name") if isinstance(n, dict) else n for n in state["nodes"]]
        parts.append(f"nodes={','.join(map(str, names))}")
    reason = trust.get("reason") or (state.get("error") or {}).get("message")
    if cluster["status"] != 200 and reason:
        parts.append(f"({reason})")
    return " ".join(parts)


def cmd_status(args: argparse.Namespace) -> int:
    db, members = read_record(args.dir)
    nodes = [node_status(m, args.token) for m in members]
    cluster = cluster_status(nodes, args.token)
    if args.json:
        doc = {"dir": str(args.dir), "db": redact_url(db), "nodes": nodes, "cluster": cluster}
        print(json.dumps(doc, indent=1))
    else:
        print(f"{args.dir}: {len(nodes)} nodes on {redact_url(db)}")
        _print_table(nodes)
        print(_cluster_line(cluster) if cluster else "cluster: no live node answers")
    if cluster is None:
        return RET_NO_NODE
    return RET_OK if cluster["status"] == 200 else RET_NOT_VOUCHED


# -- the command line ------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that says what is wrong in one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: {message}\n")
        raise SystemExit(RET_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    dir_help = f"the fleet's directory: a data directory per node, {RECORD} (default ./fleet-data)"
    # No abbreviations: an argument meant for the nodes (--pre…) is never
    # taken for one of ours.
    start = sub.add_parser(
        "start",
        allow_abbrev=False,
        help="start N nodes, wait until each is ready, print their URLs",
        epilog="Any other argument goes to every node's `python -m node run`.",
    )
    start.add_argument("n", type=int, metavar="N", help="how many nodes (1 to 255)")
    start.add_argument(
        "--db", default=DEFAULT_DB, help=f"the database, created if missing (default {DEFAULT_DB})"
    )
    start.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=dir_help)
    start.add_argument(
        "--base-port",
        type=int,
        default=DEFAULT_BASE_PORT,
        help="the first node's port, then one up each; 0 picks free ones "
        f"(default {DEFAULT_BASE_PORT})",
    )
    start.add_argument(
        "--prefix",
        default=DEFAULT_PREFIX,
        help="node names are PREFIX-1 … PREFIX-N; two fleets on one host need different ones "
        f"(default {DEFAULT_PREFIX})",
    )
    start.add_argument(
        "--wait-s",
        type=float,
        default=START_WAIT_S,
        help=f"how long to wait for every node's /readyz (default {START_WAIT_S:g})",
    )
    stop = sub.add_parser(
        "stop",
        allow_abbrev=False,
        help="SIGTERM every node of the directory, wait for them to exit",
    )
    stop.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=dir_help)
    stop.add_argument(
        "--wait-s",
        type=float,
        default=STOP_WAIT_S,
        help=f"how long to wait for them to exit (default {STOP_WAIT_S:g})",
    )
    status = sub.add_parser(
        "status", allow_abbrev=False, help="each node, then the cluster's queue state"
    )
    status.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=dir_help)
    status.add_argument("--json", action="store_true", help="one JSON document")
    status.add_argument(
        "--token",
        default=os.environ.get("QUEUE_NODE_TOKEN") or None,
        help="the fleet's token, when it has one (default $QUEUE_NODE_TOKEN)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "-v" in argv
    parser = build_parser()
    argv = [a for a in argv if a != "-v"]
    if argv[:1] == ["start"] and not (argv[1:2] and (argv[1].isdigit() or argv[1] in HELP)):
        # N first: after an option this script does not know (a node's
        # ``--workers 2``), a number could be that option's value.
        parser.error("start takes N first: scripts/fleet start N [options] [node run args]")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "start":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    commands: dict[str, Callable[[], int]] = {
        "start": lambda: cmd_start(args, extra),
        "stop": lambda: cmd_stop(args),
        "status": lambda: cmd_status(args),
    }
    try:
        return commands[args.command]()
    except ConfigError as exc:
        if verbose:
            raise
        print(f"{PROG}: {exc}", file=sys.stderr)
        return RET_USAGE
    except NoFleet as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return RET_NO_NODE
    except NodeError as exc:
        if verbose:
            raise
        print(f"{PROG}: {' '.join(str(exc).split())}", file=sys.stderr)
        return RET_ERROR
    except KeyboardInterrupt:
        return RET_ERROR


if __name__ == "__main__":
    sys.exit(main())
