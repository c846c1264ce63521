"""Nothing of the node can be taken over by another local user, and a
segment the node cannot vouch for is refused, never reused or replaced.

Each test makes the name as a real second uid (a process that drops to uid
65534 with setuid; the tests need root for that, as CI runs them), starts a
real node, and checks
that it refused with one line naming the object and its owner (exit 2), and
that nothing of the node was made or changed meanwhile.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from node.testing import ROOT, NodeProcess, cleanup_segments, finish, wait_for

OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(
    os.getuid() != 0 and not os.environ.get("CI"),
    reason="needs root to act as a second uid (CI runs as root)",
)


# The interpreter and its modules are loaded before the uid changes: the
# checkout and its virtual environment may sit where uid 65534 cannot read.
BECOME_OTHER = (
    "import mmap, os, socket, time\n"
    "import posix_ipc\n"
    f"os.setgroups([]); os.setgid({OTHER_UID}); os.setuid({OTHER_UID})\n"
)


def _as_other(code: str, *, background: bool = False) -> subprocess.Popen | None:
    """Run Python ``code`` as uid/gid 65534 (a real second user)."""
    argv = [sys.executable, "-c", BECOME_OTHER + code]
    if background:
        proc = subprocess.Popen(argv, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()  # type: ignore[union-attr]
        return proc
    done = subprocess.run(argv, cwd="/", capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return None


def _start_refused(tmp_path: Path, name: str) -> subprocess.CompletedProcess:
    data = tmp_path / "data"
    return subprocess.run(
        [sys.executable, "-m", "node", "run", "--data-dir", str(data), "--name", name,
         "--http", "127.0.0.1:0", "--workers", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _node_names(name: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if f"queue-node.{name}." in n)


def _unlink_everything(name: str) -> None:
    for entry in Path("/dev/shm").glob(f"*queue-node.{name}.*"):
        entry.unlink(missing_ok=True)
    cleanup_segments(name)


def _assert_refused(done: subprocess.CompletedProcess, what: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert what in lines[0] and f"uid {OTHER_UID}" in lines[0], lines[0]
    assert "Traceback" not in done.stderr


SEGMENT_CODE = """
import mmap, os, posix_ipc
shm = posix_ipc.SharedMemory({name!r}, posix_ipc.O_CREX, mode=0o666, size=1 << 16)
os.fchmod(shm.fd, 0o666)
m = mmap.mmap(shm.fd, 1 << 16)
m[:8] = b"attacker"
shm.close_fd()
"""


@needs_root
@pytest.mark.parametrize("kind", ["ready", "leases", "state", "classes"])
def test_a_segment_another_user_made_first_is_refused(
    tmp_path: Path, node_name: str, kind: str
) -> None:
    name = f"/queue-node.{node_name}.{kind}"
    try:
        _as_other(SEGMENT_CODE.format(name=name))
        done = _start_refused(tmp_path, node_name)
        _assert_refused(done, name)
        # nothing of the node was made, and the other user's segment is as it was
        assert _node_names(node_name) == [name.lstrip("/")]
        assert Path(f"/dev/shm{name}").read_bytes()[:8] == b"attacker"
        assert Path(f"/dev/shm{name}").stat().st_uid == OTHER_UID
    finally:
        _unlink_everything(node_name)


def test_a_file_of_this_user_in_place_of_a_segment_is_refused_naming_its_owner(
    tmp_path: Path, node_name: str
) -> None:
    """Not a queue-node segment, but this user's: refused with one line that
    names it and its owner, and left as it was."""
    import posix_ipc

    name = f"/queue-node.{node_name}.ready"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=1 << 16)
    try:
        with open(f"/dev/shm{name}", "r+b") as f:
            f.write(b"squatter")
        shm.close_fd()
        done = _start_refused(tmp_path, node_name)
        assert done.returncode == 2, (done.returncode, done.stderr)
        (line,) = done.stderr.strip().splitlines()
        assert name in line and "is not a queue-node segment" in line, line
        assert f"owned by uid {os.getuid()}" in line and "Traceback" not in done.stderr, line
        assert Path(f"/dev/shm{name}").read_bytes()[:8] == b"squatter"
    finally:
        _unlink_everything(node_name)


@needs_root
def test_a_wake_semaphore_another_user_made_first_is_refused(
    tmp_path: Path, node_name: str
) -> None:
    name = f"/queue-node.{node_name}.wake"
    code = (
        "import os, posix_ipc\n"
        f"s = posix_ipc.Semaphore({name!r}, posix_ipc.O_CREX, mode=0o666)\n"
        f"os.chmod('/dev/shm/sem.{name[1:]}', 0o666)\n"
    )
    try:
        _as_other(code)
        done = _start_refused(tmp_path, node_name)
        _assert_refused(done, name)
        assert _node_names(node_name) == [f"sem.{name[1:]}"]
    finally:
        _unlink_everything(node_name)


@needs_root
def test_an_ask_queue_another_user_made_first_is_refused(tmp_path: Path, node_name: str) -> None:
    import posix_ipc

    name = f"/queue-node.{node_name}.ask"
    code = (
        "import os, posix_ipc\n"
        f"q = posix_ipc.MessageQueue({name!r}, posix_ipc.O_CREX, mode=0o666,\n"
        "                          max_messages=4, max_message_size=8192)\n"
        "os.fchmod(q.mqd, 0o666)\n"
    )
    try:
        _as_other(code)
        done = _start_refused(tmp_path, node_name)
        _assert_refused(done, name)
        assert _node_names(node_name) == []
    finally:
        try:
            posix_ipc.unlink_message_queue(name)
        except posix_ipc.ExistentialError:
            pass
        _unlink_everything(node_name)


@needs_root
def test_a_ledger_name_another_user_bound_first_is_refused(
    tmp_path: Path, node_name: str
) -> None:
    code = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.bind('\\0queue-node.{node_name}.ledger'); s.listen(8)\n"
        "print('ready', flush=True)\n"
        "__import__('time').sleep(120)\n"
    )
    holder = _as_other(code, background=True)
    assert holder is not None
    try:
        done = _start_refused(tmp_path, node_name)
        _assert_refused(done, "ledger")
        assert _node_names(node_name) == []
    finally:
        holder.kill()
        holder.communicate(timeout=10)
        _unlink_everything(node_name)


@needs_root
def test_an_ipc_client_refuses_a_ledger_of_another_uid(node_name: str) -> None:
    """The check every client makes, whoever started first: a worker or a
    LocalClaimer never sends a result to a socket another user serves."""
    from node.core.names import ledger_address
    from node.ipc import IpcClient, IpcError

    code = (
        "import socket, time\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.bind('\\0queue-node.{node_name}.ledger'); s.listen(8)\n"
        "print('ready', flush=True)\n"
        "c, _ = s.accept(); got = c.recv(1)\n"
        "print('got', len(got), flush=True)\n"
        "time.sleep(60)\n"
    )
    holder = _as_other(code, background=True)
    assert holder is not None
    client = IpcClient(ledger_address(node_name), timeout_s=5)
    try:
        with pytest.raises(IpcError, match=f"uid {OTHER_UID}"):
            client.call("stats")
        holder.kill()
        out, _ = holder.communicate(timeout=10)
        assert "got 1" not in out  # not one byte was sent to it
    finally:
        client.close()
        if holder.returncode is None:
            holder.kill()
            holder.communicate(timeout=10)


def _crash(tmp_path: Path, node_name: str) -> NodeProcess:
    node = NodeProcess(tmp_path / "data", node_name).start()
    status, body = node.request("POST", "/rows", [{"key": "k1", "route": "r", "due_at": 0}])
    assert status == 200, body
    from node.client import Client

    with Client(node.base_url) as client:
        grants = wait_for(lambda: client.claim(1, lease_s=600, consumer="gpu"), 30, "a grant")
    assert [g.key for g in grants] == ["k1"]
    node.kill()
    return node


def test_a_segment_without_this_data_directory_identity_is_refused_until_cleared(
    tmp_path: Path, node_name: str
) -> None:
    """A crash left segments, then another data directory (another node that
    took the name) starts: it refuses them rather than reattach another
    node's leases; ``clear`` is the way out."""
    first = _crash(tmp_path, node_name)
    try:
        other = tmp_path / "other"
        done = subprocess.run(
            [sys.executable, "-m", "node", "run", "--data-dir", str(other), "--name", node_name,
             "--http", "127.0.0.1:0", "--workers", "1"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        line = done.stderr.strip()
        assert "\n" not in line and "another data directory's identity" in line, line
        # and its owner: this user, and the supervisor that made it (killed)
        assert "owned by uid" in line and "(no longer running)" in line, line
        assert f"python -m node clear {node_name}" in line
        # the first node's own restart reattaches them, live lease and all
        again = NodeProcess(tmp_path / "data", node_name).start()
        status, body = again.request("GET", "/leases")
        assert status == 200 and [lease["key"] for lease in body["leases"]] == ["k1"], body
        assert again.stop() == 0
        # clear: nothing left; then the other data directory starts
        cleared = subprocess.run([sys.executable, "-m", "node", "clear", node_name],
                                 cwd=ROOT, capture_output=True, text=True, timeout=30)  # fmt: skip
        assert cleared.returncode == 0, cleared.stderr
        assert _node_names(node_name) == []
        third = NodeProcess(other, node_name).start()
        assert third.stop() == 0
    finally:
        finish([first], node_name)


def test_a_lease_table_of_another_layout_is_refused_with_how_to_recover(
    tmp_path: Path, node_name: str
) -> None:
    """After a crash and a new build, the old build's lease table (live
    leases in it) is neither reattached nor silently replaced."""
    from shm import leases, segment

    node = _crash(tmp_path, node_name)
    try:
        path = Path(f"/dev/shm/queue-node.{node_name}.leases")
        with open(path, "r+b") as f:  # what the build before would have written
            f.seek(4)
            f.write((leases.LAYOUT_VERSION + 1).to_bytes(4, "little"))
        before = path.read_bytes()
        done = _start_refused(tmp_path, node_name)
        assert done.returncode == 2, done.stderr
        line = done.stderr.strip()
        assert "\n" not in line and "layout" in line and "stop it cleanly" in line, line
        assert f"python -m node clear {node_name}" in line
        assert path.read_bytes() == before  # the live lease is still there
        assert segment.vet  # noqa: B018 - the check the supervisor runs, importable
        held = subprocess.run([sys.executable, "-m", "node", "clear", node_name], cwd=ROOT,
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        assert held.returncode == 0, held.stderr
        assert not path.exists()
    finally:
        finish([node], node_name)


def test_clear_refuses_while_a_node_runs(tmp_path: Path, node_name: str) -> None:
    node = NodeProcess(tmp_path / "data", node_name).start()
    try:
        done = subprocess.run([sys.executable, "-m", "node", "clear", node_name], cwd=ROOT,
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        assert done.returncode == 2
        assert "still in use" in done.stderr and "\n" not in done.stderr.strip()
        assert len(_node_names(node_name)) == 5  # four segments and the semaphore
        assert node.stop() == 0
    finally:
        finish([node], node_name)


def test_the_keeper_dump_writes_only_in_the_data_directory(
    tmp_path: Path, node_name: str
) -> None:
    """A request used to name the file the keeper wrote."""
    from keeper.ask import ask

    node = NodeProcess(tmp_path / "data", node_name).start()
    target = tmp_path / "elsewhere.msgpack"
    try:
        reply = wait_for(
            lambda: ask(node_name, {"op": "dump", "path": str(target)}, timeout_s=2), 30, "dump"
        )
        assert reply["ok"]
        assert not target.exists()
        assert Path(reply["path"]).parent == (tmp_path / "data" / "run").resolve()
        assert node.stop() == 0
    finally:
        finish([node], node_name)


def test_an_ipc_client_of_this_uid_is_served(node_name: str) -> None:
    """The peer check passes a ledger of our own uid (the other side of
    ``test_an_ipc_client_refuses_a_ledger_of_another_uid``)."""
    from node.ipc import peer_uid

    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        assert peer_uid(a) == (os.getpid(), os.getuid())
    finally:
        a.close()
        b.close()


@needs_root
def test_a_link_in_place_of_the_wake_semaphore_is_refused(tmp_path: Path, node_name: str) -> None:
    """Another user's link at /dev/shm/sem.… to a file the node's user owns:
    the owner check must not follow it (it did, then the semaphore's open
    failed with a traceback after the segments were made)."""
    target = Path(f"/dev/shm/qn-target-{node_name}")
    target.write_bytes(b"\0" * 32)
    link = f"/dev/shm/sem.queue-node.{node_name}.wake"
    try:
        _as_other(f"os.symlink({str(target)!r}, {link!r})\n")
        done = _start_refused(tmp_path, node_name)
        assert done.returncode == 2, done.stderr
        line = done.stderr.strip()
        assert "\n" not in line and "not a plain file" in line and "Traceback" not in line, line
        assert _node_names(node_name) == [Path(link).name]
    finally:
        Path(link).unlink(missing_ok=True)
        target.unlink(missing_ok=True)
        _unlink_everything(node_name)


def test_a_kill_while_the_identity_is_made_leaves_none_or_a_whole_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill between creating the file and writing it used to leave an
    empty identity, and every later start failed on it."""
    from node.core import identity

    def killed(*args: object, **kwargs: object) -> None:
        raise SystemExit("killed")

    monkeypatch.setattr(identity.os, "fdopen", killed)
    with pytest.raises(SystemExit):
        identity.data_dir_id(tmp_path, create=True)
    monkeypatch.undo()
    assert not (tmp_path / identity.FILE_NAME).exists()
    assert list(tmp_path.iterdir()) == []
    made = identity.data_dir_id(tmp_path, create=True)
    assert len(made) == identity.ID_BYTES and identity.data_dir_id(tmp_path) == made


def test_a_saved_leases_file_is_set_aside_when_the_table_is_reattached(
    tmp_path: Path, node_name: str
) -> None:
    """A clean stop that saved its leases and died before it removed the
    table: the restart reattaches the table (the newer evidence) and must
    never load that file later, after a loss of the table."""
    node = _crash(tmp_path, node_name)
    data = tmp_path / "data"
    try:
        saved = data / "leases.msgpack"
        saved.write_bytes(b"a file a clean stop saved")
        again = NodeProcess(data, node_name).start()
        assert not saved.exists()
        assert (data / "leases.msgpack.loaded").read_bytes() == b"a file a clean stop saved"
        status, body = again.request("GET", "/leases")
        assert status == 200 and [lease["key"] for lease in body["leases"]] == ["k1"], body
        assert again.stop() == 0
    finally:
        finish([node], node_name)
