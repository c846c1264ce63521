"""Hosts in network namespaces on one bridge, for partition tests (issue 19,
item 5; docs/reliability.md, "Partitions").

One ``Net`` is a bridge in the root namespace (``10.77.N.1/24``, the
address the test itself talks from) and, per host, a network namespace with
a veth pair to the bridge (``10.77.N.10+i``, ``eth0`` inside). The
database is a host of its own (``10.77.N.254``): a namespace in which a TCP
forwarder (socat) listens on 5432 and hands each connection to a UNIX
socket that a second forwarder, in the root namespace, connects to the
test's PostgreSQL (``QUEUE_NODE_TEST_PG``). So a node reaches the database
and its peers only across the bridge, whatever address the server listens
on, and the test's own connections (``pg_url``, over loopback) are never
cut.

Why forwarders and not a PostgreSQL of the test's own in the namespace:
the server the suite already uses is reused with its per-run database and
its fixtures (``pg_url``, ``tests/pg.py``), there is no ``initdb`` and no
non-root server to start (seconds a test), and the cut happens on the path
between the namespaces either way: a forwarder in the database's namespace
is as cut off as a server there would be.

A cut is real packet loss: in each of the two namespaces a netfilter rule
drops what arrives from the other (``nft``; ``iptables`` when ``nft`` is
missing). Neither side gets an error on sending; its packets vanish, as on
a partitioned network, and TCP retransmits until it heals or times out.
Only the inbound side is filtered: an outbound drop would answer the sender
at once (``EPERM``), which no real partition does.

Everything is named ``qn<6 hex>…`` (unique per ``Net``) and torn down by
``close`` (the context manager's exit), also after a failure: the processes
the net started are killed by pid, the namespaces deleted (which deletes
their veth ends) and the bridge with them. Needs root, ``ip``, ``socat``
and ``nft`` or ``iptables``; ``NetUnavailable`` says which is missing.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from node.testing import NodeProcess, wait_for

PG_PORT = 5432  # the database host's forwarder, on its namespace address
DB_HOST = 254  # the database host's last octet
FIRST_HOST = 10  # host i's last octet is FIRST_HOST + i
CMD_TIMEOUT_S = 10.0  # one ip/nft/iptables command: they answer in milliseconds


class NetUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, a tool missing, the kernel
    refusing): the reason."""


def _run(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if proc.returncode != 0:
        raise NetUnavailable(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def _free_subnet() -> int:
    """A third octet N whose 10.77.N.0/24 no interface of this host uses."""
    used = set()
    for line in _run("ip", "-o", "-4", "addr", "show").splitlines():
        addr = line.split()[3]
        net = ipaddress.ip_interface(addr).network
        if net.subnet_of(ipaddress.ip_network("10.77.0.0/16")) and net.prefixlen >= 16:
            used.add(int(net.network_address.packed[2]))
    free = [n for n in range(1, 250) if n not in used]
    if not free:
        raise NetUnavailable("no free 10.77.N.0/24")
    return secrets.choice(free)


@dataclass
class Host:
    """One network namespace on the bridge."""

    ns: str
    address: str
    veth: str  # its pair's end in the root namespace, on the bridge
    cut_from: set[str] = field(default_factory=set)  # addresses whose packets it drops

    def exec_argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]


class Net:
    """A bridge, a database host and ``add_host`` hosts (module docstring)."""

    def __init__(self, pg_server: str) -> None:
        for tool in ("ip", "socat"):
            if shutil.which(tool) is None:
                raise NetUnavailable(f"{tool} is not installed")
        self.filter = (
            "nft" if shutil.which("nft") else "iptables" if shutil.which("iptables") else None
        )
        if self.filter is None:
            raise NetUnavailable("neither nft nor iptables is installed")
        if os.geteuid() != 0:
            raise NetUnavailable("network namespaces need root")
        server = urlsplit(pg_server)
        self._pg_target = (server.hostname or "127.0.0.1", server.port or 5432)
        self.tag = f"qn{secrets.token_hex(3)}"
        self.bridge = f"{self.tag}br"
        self.hosts: list[Host] = []
        self._procs: list[subprocess.Popen] = []
        self._dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self._subnet = 0
        self.db: Host | None = None

    # -- make ----------------------------------------------------------------------------------

    def __enter__(self) -> Net:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ip(self, last: int) -> str:
        return f"10.77.{self._subnet}.{last}"

    def _make(self) -> None:
        self._subnet = _free_subnet()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self._ip(1)}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        self.db = self._host("db", DB_HOST)
        # Root namespace: a UNIX socket to the test's server; the database's
        # namespace: TCP on its address to that socket.
        sock = self._dir / "pg.sock"
        host, port = self._pg_target
        self._spawn(["socat", f"UNIX-LISTEN:{sock},fork,mode=600", f"TCP:{host}:{port}"])
        wait_for(sock.exists, 10, "the root namespace's forwarder")
        self._spawn(self.db.exec_argv([
            "socat", f"TCP-LISTEN:{PG_PORT},bind={self.db.address},fork,reuseaddr",
            f"UNIX-CONNECT:{sock}",
        ]))  # fmt: skip

    def _host(self, suffix: str, last: int) -> Host:
        ns, veth = f"{self.tag}{suffix}", f"{self.tag}v{suffix}"
        host = Host(ns, self._ip(last), veth)
        _run("ip", "netns", "add", ns)
        self.hosts.append(host)  # from here on close() deletes it
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        _run("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        if self.filter == "nft":
            _run("ip", "netns", "exec", ns, "nft", "add", "table", "inet", "cut")
            _run("ip", "netns", "exec", ns, "nft", "add", "chain", "inet", "cut", "input",
                 "{ type filter hook input priority 0 ; policy accept ; }")  # fmt: skip
        return host

    def add_host(self) -> Host:
        """A new namespace on the bridge for one node."""
        i = sum(1 for h in self.hosts if h is not self.db)
        return self._host(f"h{i}", FIRST_HOST + i)

    def _spawn(self, argv: list[str]) -> None:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        self._procs.append(proc)

    def db_url(self, pg_url: str) -> str:
        """``pg_url``'s database, reached across the bridge."""
        assert self.db is not None
        name = urlsplit(pg_url).path.lstrip("/")
        user = urlsplit(pg_url).username or "postgres"
        return f"postgresql://{user}@{self.db.address}:{PG_PORT}/{name}"

    # -- cut and heal ----------------------------------------------------------------------------

    def cut(self, a: Host, b: Host) -> None:
        """Drop every packet between ``a`` and ``b``, both ways."""
        for host, other in ((a, b), (b, a)):
            if other.address not in host.cut_from:
                self._drop(host, other.address, add=True)
                host.cut_from.add(other.address)

    def cut_one_way(self, source: Host, dest: Host) -> None:
        """Drop what ``source`` sends to ``dest`` (at ``dest``), not the
        other way: ``dest``'s packets still reach ``source``. ``heal``
        undoes it."""
        if source.address not in dest.cut_from:
            self._drop(dest, source.address, add=True)
            dest.cut_from.add(source.address)

    def heal(self, a: Host, b: Host) -> None:
        """Let packets between ``a`` and ``b`` through again."""
        for host, other in ((a, b), (b, a)):
            if other.address in host.cut_from:
                self._drop(host, other.address, add=False)
                host.cut_from.discard(other.address)

    def _drop(self, host: Host, source: str, *, add: bool) -> None:
        if self.filter == "iptables":
            _run(*host.exec_argv(["iptables", "-A" if add else "-D", "INPUT", "-s", source,
                                  "-j", "DROP"]))  # fmt: skip
            return
        if add:
            _run(*host.exec_argv(["nft", "add", "rule", "inet", "cut", "input", "ip", "saddr",
                                  source, "drop"]))  # fmt: skip
            return
        # nft deletes a rule by handle: rewrite the chain with the others
        # (one script: atomic).
        rules = [f"add rule inet cut input ip saddr {a} drop" for a in sorted(host.cut_from)
                 if a != source]  # fmt: skip
        script = "\n".join(["flush chain inet cut input", *rules]) + "\n"
        proc = subprocess.run(host.exec_argv(["nft", "-f", "-"]), input=script, text=True,
                              capture_output=True, timeout=CMD_TIMEOUT_S)  # fmt: skip
        if proc.returncode != 0:
            raise NetUnavailable(f"nft in {host.ns}: {proc.stderr.strip()}")

    # -- tear down ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill what the net started, delete every namespace and the bridge."""
        for proc in self._procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its session: socat and its forks
            proc.wait()
        self._procs.clear()
        for host in self.hosts:
            # The pair goes with either end: deleted here at once, not when
            # the kernel gets round to freeing the namespace.
            for argv in (["ip", "link", "del", host.veth], ["ip", "netns", "del", host.ns]):
                subprocess.run(argv, capture_output=True, timeout=CMD_TIMEOUT_S)
        self.hosts.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True,
                       timeout=CMD_TIMEOUT_S)  # fmt: skip
        shutil.rmtree(self._dir, ignore_errors=True)


class NsNode(NodeProcess):
    """``python -m node run`` inside ``host``'s namespace, serving on its
    address (a port of the system's choosing). A node off loopback needs a
    token: give it in ``env`` (a fleet shares one)."""

    def __init__(self, host: Host, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.host = host

    def argv(self) -> list[str]:
        argv = super().argv()
        argv[argv.index("--http") + 1] = f"{self.host.address}:0"
        return self.host.exec_argv(argv)
