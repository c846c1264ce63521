"""The supervisor: ``python -m node run``.

It owns everything that must outlive a child: the listening socket, the
shared-memory segments (only the supervisor unlinks them), ``node.json``.

Start order: segments, then the keeper, then the workers (nothing is granted
before the keeper's first publish anyway; workers answer /readyz 503 until it
comes and the ledger answers on its socket). Stop order, on the first SIGTERM
or Ctrl-C: workers first (they stop taking requests and writes), then the
keeper; every join shares one deadline (``drain_timeout_s``). A second signal
kills every child at once. Nothing durable lives only in a process, so
neither path loses anything.

Restart policy: a child that dies is started again after a backoff that
doubles from 0.1 s up to 5 s, and is reset once the child has stayed up for
30 s; every restart is logged with the exit status.

Metrics: the supervisor owns ``<data-dir>/metrics``, prometheus_client's
multiprocess directory (``node.core.metrics``): emptied at the start, named in every
child's environment, and told when a child exits.

The supervisor's signal handlers only set flags and write to a wake-up pipe
(signal.set_wakeup_fd); all work happens in the loop.

File modes: the node runs with umask 077 (set here, inherited by every
child), so whatever it creates is owner-only whatever umask it was started
with, including files made by code that passes no mode (prometheus_client's
metrics files, the saved lease file). Where a wider mode is wanted it is set
explicitly with fchmod (the state buffer's 0640 for ``state_group``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from node.core import log, metrics
from node.core.config import Config, tls_context
from node.core.errors import ConfigError, NodeError
from node.core.identity import data_dir_id, new_boot_id
from node.core.proc import ENV_CONFIG, ENV_STARTED_AT, ENV_SUPERVISOR, drain_pipe, python_argv
from node.core.proc import unblock_all as unblock_signals
from node.core.urls import redact_url
from node.listen import bind_http, listening_address
from node.store import is_fleet_url

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
# A child that has run this long is considered healthy: its backoff resets.
BACKOFF_RESET_AFTER_S = 30.0
# How often the loop wakes with nothing to do (children are reaped on SIGCHLD).
IDLE_WAKE_S = 0.5
# How long a clean stop waits, after sealing the lease table, for changes in
# progress (a grant takes microseconds; a process stopped mid-change is waited
# for until it is killed or this passes, then saved as it stands).
SEAL_WAIT_S = 5.0
# Every file, directory, segment and queue the node makes is owner-only.
NODE_UMASK = 0o077
# After a reboot the ledger starts first; the others wait at most this long.
LEDGER_FIRST_TIMEOUT_S = 120.0


@dataclass
class Child:
    role: str  # "keeper", "ledger", "rows" (on PostgreSQL), "worker" or "inference"
    index: int
    argv: list[str]
    pass_fds: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    backoff_s: float = BACKOFF_MIN_S
    restart_at: float | None = None
    restarts: int = 0
    exits: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


class Supervisor:
    def __init__(self, config: Config, verbose: bool = False) -> None:
        self.config = config
        self.verbose = verbose
        self.name = config.name
        self.data_dir = config.data_dir.resolve()
        self.run_dir = self.data_dir / "run"
        self.started_at = time.time()
        self.children: list[Child] = []
        self._signals: list[int] = []
        self._sock: socket.socket | None = None
        self.http = ""
        self._segments: list[object] = []
        self.fleet = is_fleet_url(config.store_url)  # a member of a fleet (docs/fleet.md)

    # -- setup -------------------------------------------------------------------

    def prepare(self) -> None:
        """Everything that can fail on bad input, before any child starts."""
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.run_dir.mkdir(exist_ok=True, mode=0o700)
        self._refuse_second_node()
        # After the refusal: a second node must not empty the running one's files.
        try:
            self.metrics_dir = metrics.prepare_dir(self.data_dir)
        except OSError as exc:
            raise ConfigError(f"cannot prepare {self.data_dir / metrics.DIR_NAME}: {exc}") from None
        from node.handlers import check_spec
        from node.store.made import open_at_start

        # A misspelt handler module is one line and exit 2 now, not an
        # inference process in a restart loop.
        for spec in {self.config.handler, *(r.handler for r in self.config.routes.values())}:
            if spec is not None:
                check_spec(spec)
        # A missing or mismatched certificate: one line now, not a worker
        # in a restart loop.
        tls_context(self.config)
        # Open once here so a bad store (unreadable file, failed migration)
        # is one clear error now instead of a keeper in a restart loop. Only
        # here is the store made, and only by the data directory's rule
        # (node/store/made.py): the children never make it.
        open_at_start(self.config.store_url, self.data_dir).close()
        # Every host-wide name is ours or absent, checked before anything is
        # created: a refusal leaves nothing behind (docs/reliability.md).
        self.identity = (data_dir_id(self.data_dir, create=True), new_boot_id())
        self._check_names()
        self._sock = bind_http(self.config)
        self.http = listening_address(self._sock)
        self._write_config()
        self._create_segments()

    def _refuse_second_node(self) -> None:
        from shm.state import StateBuffer

        try:
            state = StateBuffer.attach(self.name)
        except NodeError:
            return
        try:
            pid = state.read().get("owner_pid")
        finally:
            state.close()
        from shm.segment import pid_alive

        if pid and pid != os.getpid() and pid_alive(pid):
            raise ConfigError(f"a node named {self.name!r} already runs on this host (pid {pid})")

    def _check_names(self) -> None:
        from node.names import check_all
        from shm import classes, leases, ready, state

        layouts = {"ready": ready.LAYOUT_VERSION, "leases": leases.LAYOUT_VERSION,
                   "state": state.LAYOUT_VERSION, "classes": classes.LAYOUT_VERSION}  # fmt: skip
        check_all(self.name, self.identity[0], layouts)

    def _write_config(self) -> None:
        path = self.run_dir / "config.json"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        doc = self.config.to_json()
        if self.http and not self.http.startswith("unix:"):
            # The address bound (port 0 becomes the port the system chose):
            # what a fleet's node list records as where this node serves.
            doc["http"] = self.http
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
        self.config_path = path

    def _create_segments(self) -> None:
        from shm.leases import LeaseTable
        from shm.ready import ReadySet
        from shm.state import StateBuffer
        from shm.wake import Wake

        self.ready = ReadySet.create(self.name, self.config.ready_size, identity=self.identity)
        # A fleet node grants nothing before its keeper's first heartbeat (even
        # from a set a crash left); a single node has no deadline (0).
        self.ready.set_grant_until(1 if self.fleet else 0)
        self.leases = LeaseTable.create(
            self.name,
            capacity=self.config.lease_capacity,
            max_misses=self.config.max_misses,
            identity=self.identity,
        )
        self._load_saved_leases()
        self.state = StateBuffer.create(
            self.name,
            group=self.config.state_group,
            started_at=self.started_at,
            identity=self.identity,
        )
        self.wake = Wake.create(self.name)
        self._create_classes()

    def _create_classes(self) -> None:
        """The shared class table (shm/classes.py), filled with the classes
        of the store's rows before any worker can reserve one, so that a row
        written before this start keeps its class's slot. Past
        ``max_classes`` (rows other programs wrote), the classes of the
        oldest rows have the slots."""
        from node.store import open_store
        from shm.classes import SharedClasses, fits

        self.classes = SharedClasses.create(
            self.name, self.config.max_classes, identity=self.identity
        )
        with open_store(self.config.store_url, node_name=self.name) as store:
            found = [t for t in store.classes_in_use(self.config.max_classes) if fits(t)]
        taken = self.classes.reserve(found[: self.config.max_classes])
        if len(found) > taken:
            log.warn("classes_over_limit", classes=len(found), max_classes=self.config.max_classes)

    @property
    def leases_file(self) -> Path:
        return self.data_dir / "leases.msgpack"

    def _load_saved_leases(self) -> None:
        """Restart trusts evidence: a table a crash left in shared memory is
        reattached as it is; otherwise the leases a clean shutdown saved are
        put back, and the file is kept until the next clean save."""
        if self.leases.segment.reattached:
            log.log("leases_reattached", live=self.leases.live_count())
            if self.leases_file.exists():
                # A clean stop saved it, then died before it unlinked the
                # table: the table is the newer evidence, and this file must
                # never come back after a later loss of the table.
                os.replace(self.leases_file, self.leases_file.with_name(
                    self.leases_file.name + ".loaded"))  # fmt: skip
            return
        if self.leases_file.exists():
            placed = self.leases.load(self.leases_file)
            # Loaded once: a later crash must not bring these back (the
            # shared-memory table is the evidence from now on).
            loaded = self.leases_file.with_name(self.leases_file.name + ".loaded")
            os.replace(self.leases_file, loaded)
            log.log("leases_loaded", placed=placed, path=str(self.leases_file))

    def _save_leases(self) -> None:
        """Seal the table, wait for changes in progress, then save: a process
        that outlives this node (a LocalClaimer) can change nothing after the
        seal, so nothing it grants is missing from the file (its grant is
        refused, and it reattaches to the next node)."""
        self.leases.seal()
        if not self.leases.wait_settled(time.monotonic() + SEAL_WAIT_S):
            log.warn("leases_unsettled", wait_s=SEAL_WAIT_S)
        saved = self.leases.save(self.leases_file, time.time())
        log.log("leases_saved", entries=saved, path=str(self.leases_file))

    def _unlink_segments(self) -> None:
        from keeper.ask import unlink_all
        from shm.classes import SharedClasses
        from shm.leases import LeaseTable
        from shm.ready import ReadySet
        from shm.state import StateBuffer
        from shm.wake import Wake

        for seg in (self.ready, self.state, self.wake, self.leases, self.classes):
            try:
                seg.close()
            except Exception as exc:  # noqa: BLE001 - shutting down; say and go on
                log.warn("segment_close_failed", error=str(exc))
        ReadySet.unlink(self.name)
        StateBuffer.unlink(self.name)
        Wake.unlink(self.name)
        LeaseTable.unlink(self.name)
        SharedClasses.unlink(self.name)
        unlink_all(self.name)

    # -- children -------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[ENV_CONFIG] = str(self.config_path)
        env[ENV_SUPERVISOR] = str(os.getpid())
        env[ENV_STARTED_AT] = repr(self.started_at)
        # Read by prometheus_client when the child imports it: set before exec.
        env[metrics.ENV_DIR] = str(self.metrics_dir)
        if self.verbose:
            env["QUEUE_NODE_VERBOSE"] = "1"
        return env

    def _plan_children(self) -> None:
        assert self._sock is not None
        fd = self._sock.fileno()
        self.children.append(Child("keeper", 0, python_argv("keeper")))
        self.children.append(Child("ledger", 0, python_argv("workers.ledger")))
        if self.fleet:  # claims read rows through its pool, not their own (workers/rows)
            self.children.append(Child("rows", 0, python_argv("workers.rows")))
        for i in range(1, self.config.workers + 1):
            argv = python_argv("workers.http", "--index", str(i), "--listen-fd", str(fd))
            self.children.append(Child("worker", i, argv, pass_fds=(fd,)))
        for i, device in enumerate(self._inference_devices()):
            argv = python_argv("workers.inference", "--index", str(i))
            env = {}
            if device is not None:
                # One process per GPU: it sees only its own card, as cuda:0.
                argv += ["--gpu", str(device)]
                env["CUDA_VISIBLE_DEVICES"] = str(device)
            self.children.append(Child("inference", i, argv, env=env))

    def _inference_devices(self) -> list[int | None]:
        if self.config.handler is None:
            return []
        if self.config.gpus:
            return list(self.config.gpus)
        return [None] * max(self.config.inference_procs, 1)

    def _ledger_first(self) -> None:
        """After a host reboot (or a power loss) the lease table is new and
        the schedule may have lost the ledger's last write-backs, which its
        log still holds: the ledger writes them back at start. Until then the
        keeper must not publish those keys with their old due times, so the
        ledger starts alone and the others once it serves (or has died,
        or LEDGER_FIRST_TIMEOUT_S has passed: said in the log). With the
        table reattached (a restart, the host up) nothing was lost, and all
        start at once."""
        from node.core.config import LOG_DIR
        from node.core.names import ledger_address
        from node.ipc import IpcClient, IpcError

        if self.leases.segment.reattached or not any((self.data_dir / LOG_DIR).glob("*.seg")):
            return

        ledger = next(c for c in self.children if c.role == "ledger")
        self._spawn(ledger)
        assert ledger.proc is not None
        deadline = time.monotonic() + LEDGER_FIRST_TIMEOUT_S
        while time.monotonic() < deadline and ledger.proc.poll() is None:
            try:
                client = IpcClient(ledger_address(self.name), timeout_s=2)
                try:
                    client.call("stats")
                finally:
                    client.close()
                log.log("ledger_first", reason="lease table new, log not empty", serving=True)
                return
            except (IpcError, OSError):
                time.sleep(0.05)  # polling its socket to a deadline
        log.warn("ledger_first", reason="lease table new, log not empty", serving=False,
                 exited=ledger.proc.poll())  # fmt: skip

    def _spawn(self, child: Child) -> None:
        # Block the signals we handle while forking, so a signal cannot land
        # in the child between fork and exec and run our handler there.
        handled = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD}
        old = signal.pthread_sigmask(signal.SIG_BLOCK, handled)
        try:
            child.proc = subprocess.Popen(
                child.argv,
                env={**self._env(), **child.env},
                pass_fds=child.pass_fds,
                stdin=subprocess.DEVNULL,
                restore_signals=True,
                preexec_fn=unblock_signals,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        child.started_at = time.monotonic()
        child.restart_at = None
        log.log("child_start", role=child.role, index=child.index, pid=child.proc.pid)

    def _reap(self, now: float) -> bool:
        changed = False
        for child in self.children:
            proc = child.proc
            if proc is None or proc.poll() is None:
                continue
            status = proc.returncode
            how = f"signal {-status}" if status < 0 else f"exit {status}"
            child.exits.append(how)
            up_s = now - child.started_at
            if up_s >= BACKOFF_RESET_AFTER_S:
                child.backoff_s = BACKOFF_MIN_S
            child.restart_at = now + child.backoff_s
            log.warn(
                "child_died",
                role=child.role,
                index=child.index,
                pid=proc.pid,
                status=how,
                up_s=round(up_s, 3),
                restart_in_s=child.backoff_s,
            )
            child.backoff_s = min(child.backoff_s * 2, BACKOFF_MAX_S)
            child.proc = None
            self._metrics_forget(proc.pid)
            changed = True
        for child in self.children:
            if child.proc is None and child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                self._spawn(child)
                changed = True
        return changed

    def _metrics_forget(self, pid: int) -> None:
        # Its counters stay in the directory (a restarted worker still counts
        # what it did before); a failure here must not stop the restart.
        try:
            metrics.process_died(pid, self.metrics_dir)
        except OSError as exc:
            log.warn("metrics_forget_failed", pid=pid, error=str(exc))

    def _next_restart_in(self, now: float) -> float:
        waits = [c.restart_at - now for c in self.children if c.restart_at is not None]
        return max(0.0, min(waits, default=IDLE_WAKE_S))

    def write_node_json(self) -> None:
        doc = {
            "name": self.name,
            "pid": os.getpid(),
            "http": self.http,
            "started_at": self.started_at,
            "data_dir": str(self.data_dir),
            "pids": {
                "keeper": next((c.pid for c in self.children if c.role == "keeper"), None),
                "workers": [c.pid for c in self.children if c.role == "worker"],
                "ledger": next((c.pid for c in self.children if c.role == "ledger"), None),
                "rows": next((c.pid for c in self.children if c.role == "rows"), None),
                "inference": [c.pid for c in self.children if c.role == "inference"],
            },
        }
        path = self.data_dir / "node.json"
        tmp = path.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, path)

    # -- run -----------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def run(self) -> int:
        self.prepare()
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wfd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)
        self._plan_children()
        self._ledger_first()
        for child in self.children:
            if child.proc is None:
                self._spawn(child)
        self.write_node_json()
        log.log(
            "node_start",
            name=self.name,
            http=self.http,
            workers=self.config.workers,
            store=redact_url(self.config.store_url),
            data_dir=str(self.data_dir),
        )
        try:
            return self._loop(rfd)
        finally:
            os.close(rfd)
            os.close(wfd)

    def _loop(self, rfd: int) -> int:
        while True:
            timeout = self._next_restart_in(time.monotonic())
            try:
                select.select([rfd], [], [], timeout)
            except InterruptedError:
                pass
            drain_pipe(rfd)
            signals, self._signals = self._signals, []
            if signal.SIGTERM in signals or signal.SIGINT in signals:
                return self.stop()
            if signal.SIGHUP in signals:
                self._reload()
            if self._reap(time.monotonic()):
                self.write_node_json()

    def _reload(self) -> None:
        """SIGHUP: read the config file again; the keeper reclassifies rows in
        memory. Options that need a restart (ports, sizes) keep their values."""
        import dataclasses

        from node.core.config import load_config

        if self.config.config_file is None:
            log.log("reload_skipped", reason="no config file")
            return
        try:
            fresh = load_config(config_file=self.config.config_file)
        except ConfigError as exc:
            log.warn("reload_refused", error=str(exc))
            return
        self.config = dataclasses.replace(self.config, defaults=fresh.defaults, routes=fresh.routes)
        self._write_config()
        for child in self.children:
            if child.role == "keeper" and child.proc is not None:
                child.proc.send_signal(signal.SIGHUP)
        log.log("reload", routes=len(fresh.routes))

    def stop(self) -> int:
        """Drain, in this order, within one shared deadline:

        1. inference processes and HTTP workers: they stop granting, let the
           running batches finish (or hand their leases back) and send their
           last results to the ledger;
        2. the ledger: it makes every accepted result durable and exits;
           with it the row service (nothing claims any more);
        3. the keeper.

        Then the live leases are saved and the segments removed. A second
        signal during the drain kills everything at once; nothing durable is
        lost either way (the log and the store are on disk, and a crash leaves
        the segments for the next start to reattach)."""
        deadline = time.monotonic() + self.config.drain_timeout_s
        log.log("node_draining", deadline_s=self.config.drain_timeout_s)
        granting = [c for c in self.children if c.role in ("inference", "worker")]
        ledgers = [c for c in self.children if c.role in ("ledger", "rows")]
        keepers = [c for c in self.children if c.role == "keeper"]
        killed = False
        self._leave_fleet(keepers)
        for group in (granting, ledgers, keepers):
            for child in group:
                if child.proc is not None and child.proc.poll() is None:
                    child.proc.terminate()
            for child in group:
                if child.proc is None:
                    continue
                while child.proc.poll() is None:
                    # SIGCHLD arrives as children exit: only a second TERM
                    # or INT means "stop now".
                    if not killed and {signal.SIGTERM, signal.SIGINT} & set(self._signals):
                        self._kill_all()
                        killed = True
                    if time.monotonic() >= deadline:
                        log.warn("drain_timeout", role=child.role, pid=child.proc.pid)
                        child.proc.kill()
                        child.proc.wait()
                        break
                    try:
                        child.proc.wait(timeout=0.05)
                    except subprocess.TimeoutExpired:
                        pass
        self._save_leases()
        self._unlink_segments()
        try:
            (self.data_dir / "node.json").unlink()
        except FileNotFoundError:
            pass
        if self.config.http_unix is not None:
            self.config.http_unix.unlink(missing_ok=True)
        restarts = sum(c.restarts for c in self.children)
        log.log(
            "node_stop",
            name=self.name,
            up_s=round(time.time() - self.started_at, 1),
            restarts=restarts,
            forced=killed,
        )
        return 0

    def _leave_fleet(self, keepers: list[Child]) -> None:
        """A fleet node leaves the node list as its drain begins (its keeper
        does, on SIGUSR1: keeper/fleet.py), so its rows move at once."""
        for child in keepers if self.fleet else ():
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGUSR1)

    def _kill_all(self) -> None:
        log.warn("node_kill", reason="second signal")
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.kill()


def run(config: Config, verbose: bool = False) -> int:
    log.setup("supervisor", verbose)
    os.umask(NODE_UMASK)
    return Supervisor(config, verbose).run()
