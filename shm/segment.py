"""Named shared-memory segments: the common header, futexes, and who owns what.

Segments are POSIX shared memory (``posix_ipc.SharedMemory``) mapped with
``mmap``. We do not use ``multiprocessing.shared_memory``: it registers every
segment it opens with multiprocessing's resource tracker, and the tracker of a
process that merely *attached* unlinks the segment when that process exits, out
from under the supervisor and every other reader. Here nothing is registered
anywhere.

Ownership: only the supervisor creates and unlinks segments (``create``,
``create_or_reattach``, ``unlink``). Everyone else ``attach``-es and ``close``-s.

Every segment starts with the same 24-byte header; the per-kind fields follow
it (see ``shm/ready/layout.py`` and ``shm/state.py`` for their offset tables)::

    offset  size  field            format
    0       4     magic            4s   b"QNSH"; written last at create
    4       4     layout_version   I    per kind; a mismatch is LayoutMismatch
    8       4     writer_pid       I    the process that writes the contents
    12      4     owner_pid        I    the supervisor that created the segment
    16      8     total_size       Q    bytes, as created, the identity included
    24      ...   per-kind fields

and ends with the same 64-byte identity block, at ``total_size - 64``, past
the per-kind fields (whose offsets, compiled into the C modules, it leaves
where they were)::

    offset  size  field            format
    0       4     magic            4s   b"QNID"
    4       4     version          I    1
    8       16    data_dir_id      16s  the data directory's identity (node/core/identity.py)
    24      16    boot_id          16s  random, new at every start of the supervisor
    40      24    reserved

Trust (docs/reliability.md): the supervisor creates every name exclusively
(O_EXCL) and reattaches an existing segment only when it is owned by the
node's uid, carries this data directory's identity and has the layout this
build writes; anything else is refused at start (``NameTaken``,
``StaleLayout``), never unlinked behind the operator's back. Other processes
attach only segments their own uid owns (a group reader of the state buffer
excepted: it maps it read-only and writes nothing).

All multi-byte fields are little-endian and naturally aligned, on a
little-endian Linux host (x86_64 or aarch64). CPython's ``struct`` is plain
``memcpy``, with no fences, so no seqlock or publishing word is read or written
with it where another CPU may see the order wrong: those loads and stores go
through ``shm._atomic`` (and the C claim path) with explicit C11 acquire and
release orders, correct on a weakly ordered CPU as on x86's TSO. Each
protocol's orders and why they suffice: docs/shm.md, "Memory ordering". What
Python still reads with ``struct`` is a writer's own fields or a hint (an
aligned 4- or 8-byte ``memcpy`` is one load on both architectures).
"""

from __future__ import annotations

import grp
import mmap
import os
import struct
from collections.abc import Callable
from typing import Any

import posix_ipc

from node.core.errors import LayoutMismatch, NameTaken, NodeError, NodeNotRunning
from node.core.names import node_of_segment, owner_name

# The futexes live in shm/futex.py; their names are re-exported here.
from shm.futex import FUTEX_WAIT as FUTEX_WAIT
from shm.futex import FUTEX_WAKE as FUTEX_WAKE
from shm.futex import INT_MAX, futex_wait, futex_wake
from shm.futex import SYS_FUTEX as SYS_FUTEX

MAGIC = b"QNSH"
IDENTITY_MAGIC = b"QNID"
IDENTITY_VERSION = 1
# offset table above; the block sits at total_size - IDENTITY_SIZE
IDENTITY = struct.Struct("<4sI16s16s24x")
IDENTITY_SIZE = IDENTITY.size  # 64
ID_BYTES = 16
# The identity of segments made without one (tests, tools): it matches only
# segments made the same way, never a node's.
ANONYMOUS = (bytes(ID_BYTES), bytes(ID_BYTES))

# offset table above
HEADER = struct.Struct("<4sIIIQ")
HEADER_SIZE = HEADER.size  # 24: per-kind fields start here
WRITER_PID_OFFSET = 8
OWNER_PID_OFFSET = 12
U32 = struct.Struct("<I")


class SnapshotUnstable(NodeError):
    """A seqlocked region kept changing under the reader for too many tries."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists and is not a zombie.

    A pid can be reused after its process dies; a reader that must be sure
    pairs this with a heartbeat age.
    """
    if not 0 < pid < 1 << 31:  # no process has it (and os.kill would overflow)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    # "pid (comm) S ...": the comm may contain spaces and parentheses.
    after_comm = stat.rfind(b")")
    return stat[after_comm + 2 : after_comm + 3] not in (b"Z", b"X")


# -- segments -----------------------------------------------------------------


class Segment:
    """One mapped segment. Close it when done; only the supervisor unlinks."""

    def __init__(
        self,
        name: str,
        mm: mmap.mmap,
        read_only: bool,
        reattached: bool = False,
        inode: int = 0,
    ):
        self.name = name
        self.mm = mm
        #: the shared-memory file this mapping is of (0: unknown)
        self.inode = inode
        self.size = len(mm)
        self.read_only = read_only
        #: True when ``create_or_reattach`` found the segment a crash left behind.
        self.reattached = reattached

    @property
    def layout_version(self) -> int:
        return HEADER.unpack_from(self.mm, 0)[1]

    def still_named(self) -> bool:
        """Whether the name still leads to this mapping: False once the
        supervisor unlinked it, or a new segment took the name (a restart)."""
        try:
            return os.stat(f"/dev/shm{self.name}").st_ino == self.inode
        except OSError:
            return False

    @property
    def identity(self) -> tuple[bytes, bytes] | None:
        """``(data_dir_id, boot_id)`` from the identity block; None when the
        segment has none (made by a build before it, or not ours)."""
        return read_identity(self.mm, self.size)

    def stamp(self, data_dir_id: bytes, boot_id: bytes) -> None:
        """Supervisor: mark the segment as this data directory's, for this boot."""
        _write_identity(self.mm, self.size, data_dir_id, boot_id)

    @property
    def writer_pid(self) -> int:
        return U32.unpack_from(self.mm, WRITER_PID_OFFSET)[0]

    @property
    def owner_pid(self) -> int:
        return U32.unpack_from(self.mm, OWNER_PID_OFFSET)[0]

    def set_writer_pid(self, pid: int | None = None) -> None:
        U32.pack_into(self.mm, WRITER_PID_OFFSET, os.getpid() if pid is None else pid)

    def set_owner_pid(self, pid: int | None = None) -> None:
        U32.pack_into(self.mm, OWNER_PID_OFFSET, os.getpid() if pid is None else pid)

    def futex_wait(self, offset: int, expected: int, timeout_s: float | None) -> bool:
        return futex_wait(self.mm, offset, expected, timeout_s)

    def futex_wake(self, offset: int, n: int = INT_MAX) -> int:
        return futex_wake(self.mm, offset, n)

    @property
    def closed(self) -> bool:
        return self.mm.closed

    def close(self) -> None:
        """Unmap. Never unlinks: the name stays for every other process.

        Raises BufferError, naming the segment, while something still holds a
        view of the mapping (a thread inside ``futex_wait``, a memoryview):
        unmapping under it would leave it reading freed memory.
        """
        if self.mm.closed:
            return
        try:
            self.mm.close()
        except BufferError as exc:
            raise BufferError(
                f"{self.name}: cannot unmap while a futex wait or a memoryview still uses it"
            ) from exc

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.mm.closed else f"{self.size} bytes"
        return f"<Segment {self.name} {state}>"


# madvise(MADV_POPULATE_WRITE), Linux 5.14+ (the mmap module names it from 3.12).
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def populate(mm: mmap.mmap) -> bool:
    """Fault in every page of a shared mapping, writable, changing nothing:
    the pages are allocated and mapped now instead of at their first write
    (a fresh lease table's first grants paid ~3 us each in page faults).
    False where the kernel cannot (older than 5.14): pages fault in as used."""
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        return False
    return True


def read_identity(mm: Any, size: int) -> tuple[bytes, bytes] | None:
    if size < HEADER_SIZE + IDENTITY_SIZE:
        return None
    magic, version, data_dir_id, boot_id = IDENTITY.unpack_from(mm, size - IDENTITY_SIZE)
    if magic != IDENTITY_MAGIC or version != IDENTITY_VERSION:
        return None
    return data_dir_id, boot_id


def _write_identity(mm: Any, size: int, data_dir_id: bytes, boot_id: bytes) -> None:
    if len(data_dir_id) != ID_BYTES or len(boot_id) != ID_BYTES:
        raise ValueError(f"identities are {ID_BYTES} bytes")
    IDENTITY.pack_into(
        mm, size - IDENTITY_SIZE, IDENTITY_MAGIC, IDENTITY_VERSION, data_dir_id, boot_id
    )


def check_owner(name: str, uid: int) -> None:
    """NameTaken unless ``name`` (a segment, semaphore or queue) belongs to this uid."""
    if uid != os.getuid():
        raise NameTaken(
            f"{name} is owned by {owner_name(uid)}, not by this node's user "
            f"({owner_name(os.getuid())}): refusing to use it; remove it "
            f"(python -m node clear NAME, as its owner or root) or pick another --name"
        )


def _resolve_gid(group: str | int) -> int:
    if isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise NodeError(f"group {group!r} does not exist on this host") from None


def _set_access(fd: int, mode: int, group: str | int | None) -> None:
    # shm_open applies the umask; fchmod sets exactly what we asked for.
    if group is not None:
        os.fchown(fd, -1, _resolve_gid(group))
        mode |= 0o040
    os.fchmod(fd, mode)


def create(
    name: str,
    size: int,
    layout_version: int,
    mode: int = 0o600,
    group: str | int | None = None,
    init: Callable[[mmap.mmap], None] | None = None,
    identity: tuple[bytes, bytes] | None = None,
) -> Segment:
    """Create ``name`` (it must not exist), map it and write the header (and
    the identity block, ``(data_dir_id, boot_id)``, when given).

    ``size`` is the per-kind size; the segment is ``IDENTITY_SIZE`` larger.

    ``init`` fills the per-kind fields before the magic is written, so a
    process attaching meanwhile sees "not initialised yet", never half a header.
    With ``group``, the segment belongs to that group and is mode 0640.
    """
    if size < HEADER_SIZE:
        raise ValueError(f"segment size {size} is smaller than the header ({HEADER_SIZE})")
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
    except posix_ipc.ExistentialError:
        raise NameTaken(
            f"{name} already exists: it appeared while the node was creating it, and only "
            "the node's supervisor creates it; is another process racing this start?"
        ) from None
    total = size + IDENTITY_SIZE
    try:
        _set_access(shm.fd, mode, group)
        os.ftruncate(shm.fd, total)
        inode = os.fstat(shm.fd).st_ino
        mm = mmap.mmap(shm.fd, total)
    except BaseException:
        shm.close_fd()
        unlink(name)
        raise
    shm.close_fd()  # the mapping keeps the memory; the fd is not needed
    pid = os.getpid()
    HEADER.pack_into(mm, 0, b"\0\0\0\0", layout_version, pid, pid, total)
    if init is not None:
        init(mm)
    _write_identity(mm, total, *(identity or ANONYMOUS))
    mm[0:4] = MAGIC
    return Segment(name, mm, read_only=False, inode=inode)


class StaleLayout(LayoutMismatch):
    """A segment of this node's, from a build with another layout, is still
    there after a crash: it may hold live leases, so it is neither reused nor
    silently replaced. Refused at start with what to do."""


def _open_existing(name: str, read_only: bool = False) -> posix_ipc.SharedMemory | None:
    try:
        return posix_ipc.SharedMemory(name, read_only=read_only)
    except posix_ipc.ExistentialError:
        return None
    except posix_ipc.PermissionsError as exc:
        raise NodeError(f"{name}: permission denied ({exc}); is this user in its group?") from exc


def owner_pid_of(name: str) -> int | None:
    """The supervisor pid in the header of segment ``name`` when it is this
    uid's and a queue-node segment, read without mapping it (a segment of
    another user's is never read: its owner could resize it under a
    mapping); None otherwise."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except (posix_ipc.Error, ValueError):
        return None  # absent, not ours to open, or not a name at all
    try:
        if os.fstat(shm.fd).st_uid != os.getuid():
            return None
        head = os.pread(shm.fd, HEADER.size, 0)
    except OSError:
        return None
    finally:
        shm.close_fd()
    if len(head) < HEADER.size:
        return None
    magic, _layout, _writer, owner_pid, _total = HEADER.unpack(head)
    return owner_pid if magic == MAGIC and owner_pid else None


def _check_attach_owner(name: str, fd: int, read_only: bool) -> None:
    st = os.fstat(fd)
    if st.st_uid == os.getuid():
        return
    # A member of the state buffer's group maps it read-only; a segment that
    # others than its owner could write is nobody's evidence.
    if read_only and not st.st_mode & 0o022:
        return
    check_owner(name, st.st_uid)


def attach(
    name: str,
    expected_layout: int,
    read_only: bool = False,
    data_dir_id: bytes | None = None,
) -> Segment:
    """Map an existing segment; NodeNotRunning if absent, LayoutMismatch if
    foreign, NameTaken when another user owns it (or, with ``data_dir_id``,
    when it is not that data directory's)."""
    shm = _open_existing(name, read_only)
    if shm is None:
        raise NodeNotRunning(f"{name} does not exist: no node of that name runs on this host")
    try:
        _check_attach_owner(name, shm.fd, read_only)
        inode = os.fstat(shm.fd).st_ino
        size = shm.size
        if size < HEADER_SIZE:
            raise NodeNotRunning(f"{name} is not initialised yet (the node is starting)")
        access = mmap.ACCESS_READ if read_only else mmap.ACCESS_WRITE
        mm = mmap.mmap(shm.fd, size, access=access)
    finally:
        shm.close_fd()
    magic, layout, _writer, _owner, total = HEADER.unpack_from(mm, 0)
    problem = None
    if magic == b"\0\0\0\0":
        mm.close()
        raise NodeNotRunning(f"{name} is not initialised yet (the node is starting)")
    if magic != MAGIC:
        problem = f"magic {magic!r}, expected {MAGIC!r}"
    elif layout != expected_layout:
        problem = f"layout version {layout}, expected {expected_layout}"
    elif total != size:
        problem = f"header says {total} bytes but the segment has {size}"
    if problem is not None:
        mm.close()
        raise LayoutMismatch(f"{name}: {problem}; restart the node with a matching build")
    if data_dir_id is not None:
        found = read_identity(mm, size)
        if found is None or found[0] != data_dir_id:
            mm.close()
            raise NameTaken(
                f"{name} carries {'no' if found is None else 'another'} data directory's "
                "identity: it is not this node's"
            )
    return Segment(name, mm, read_only=read_only, inode=inode)


def vet(name: str, layout_version: int, data_dir_id: bytes) -> str | None:
    """What is under ``name`` and whether this node may take it over, changing
    nothing: None when absent, ``"blank"`` for a segment of this uid's that was
    never initialised (a crash mid-create), ``"ours"`` for one this node may
    reattach. Raises NameTaken for another owner, no identity or another data
    directory's identity, StaleLayout for this node's segment of another layout.
    """
    shm = _open_existing(name)
    if shm is None:
        return None
    try:
        uid = os.fstat(shm.fd).st_uid
        check_owner(name, uid)
        found = shm.size
        if found < HEADER_SIZE:
            return "blank"
        mm = mmap.mmap(shm.fd, found, access=mmap.ACCESS_READ)
    finally:
        shm.close_fd()
    try:
        magic, layout, _writer, owner_pid, total = HEADER.unpack_from(mm, 0)
        if magic == b"\0\0\0\0":
            return "blank"
        theirs = read_identity(mm, found) if total == found else None
    finally:
        mm.close()
    if magic != MAGIC or theirs is None or theirs[0] != data_dir_id:
        what = "is not a queue-node segment" if magic != MAGIC else (
            "carries no data directory identity (made by an older build?)" if theirs is None
            else "carries another data directory's identity"
        )
        # Its owner: this uid (another's is refused above), and for a
        # queue-node segment the supervisor that made it, alive or not.
        owner = owner_name(uid)
        if magic == MAGIC:
            owner += f", made by the supervisor pid {owner_pid} (" + (
                "a process of that pid runs)" if pid_alive(owner_pid) else "no longer running)")
        raise NameTaken(
            f"{name} {what} (owned by {owner}): refusing to reuse it; if no node uses it, "
            f"remove it with 'python -m node clear {node_of_segment(name)}'"
        )
    if layout != layout_version:
        raise StaleLayout(
            f"{name} has layout {layout} but this build writes {layout_version}: a crash left "
            "it with what it held (live leases). Start the build that made it and stop it "
            "cleanly (its leases are saved and carried across), or run "
            f"'python -m node clear {node_of_segment(name)}' and accept that its leased keys "
            "may be granted again"
        )
    return "ours"


def create_or_reattach(
    name: str,
    size: int,
    layout_version: int,
    mode: int = 0o600,
    group: str | int | None = None,
    init: Callable[[mmap.mmap], None] | None = None,
    identity: tuple[bytes, bytes] | None = None,
) -> Segment:
    """For the supervisor at start: reuse what a crash left, else start fresh.

    ``identity`` is ``(data_dir_id, boot_id)``. A segment already under the
    name is reattached (``.reattached`` is True; its contents are kept, its
    owner and writer become this process, its boot id becomes ours) only when
    ``vet`` says it is ours: refused otherwise, never unlinked. Only two
    things are replaced: a segment of ours never initialised, and one of ours
    whose size no longer fits the configuration (the ready set and the state
    buffer hold nothing a restart needs; the lease table asks for the size it
    finds).
    """
    identity = identity or ANONYMOUS
    found = vet(name, layout_version, identity[0])
    if found is None:
        return create(name, size, layout_version, mode, group, init, identity)
    seg = attach(name, layout_version) if found == "ours" else None
    if seg is None or seg.size != size + IDENTITY_SIZE:
        if seg is not None:
            seg.close()
        unlink(name)
        return create(name, size, layout_version, mode, group, init, identity)
    shm = posix_ipc.SharedMemory(name)
    try:
        _set_access(shm.fd, mode, group)
    finally:
        shm.close_fd()
    seg.reattached = True
    seg.set_owner_pid()
    seg.set_writer_pid()
    seg.stamp(*identity)
    return seg


def unlink(name: str) -> bool:
    """Remove the name (supervisor only). Mappings elsewhere stay valid. False if absent."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True
