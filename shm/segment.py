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
it (see ``shm/ready.py`` and ``shm/state.py`` for their offset tables)::

    offset  size  field            format
    0       4     magic            4s   b"QNSH"; written last at create
    4       4     layout_version   I    per kind; a mismatch is LayoutMismatch
    8       4     writer_pid       I    the process that writes the contents
    12      4     owner_pid        I    the supervisor that created the segment
    16      8     total_size       Q    bytes, as created
    24      ...   per-kind fields

All multi-byte fields are little-endian and naturally aligned. This module and
its users assume x86_64 Linux: aligned 4- and 8-byte loads and stores are
single instructions (CPython's ``struct`` uses ``memcpy`` for ``<I``/``<Q`` on a
little-endian host), and stores become visible to other CPUs in program order
(TSO), which is all the seqlocks in this package rely on.
"""

from __future__ import annotations

import ctypes
import errno
import grp
import mmap
import os
import struct
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import posix_ipc

from node.errors import LayoutMismatch, NodeError, NodeNotRunning

MAGIC = b"QNSH"

# offset table above
HEADER = struct.Struct("<4sIIIQ")
HEADER_SIZE = HEADER.size  # 24: per-kind fields start here
WRITER_PID_OFFSET = 8
OWNER_PID_OFFSET = 12
U32 = struct.Struct("<I")

INT_MAX = 0x7FFFFFFF

# x86_64 syscall number and futex ops. No FUTEX_PRIVATE_FLAG: the words are
# shared between processes, and private futexes only match within one process.
SYS_FUTEX = 202
FUTEX_WAIT = 0
FUTEX_WAKE = 1


class SnapshotUnstable(NodeError):
    """A seqlocked region kept changing under the reader for too many tries."""


def segment_name(node: str, kind: str) -> str:
    """The host-wide name of ``node``'s segment (or semaphore) of ``kind``."""
    return f"/queue-node.{node}.{kind}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists and is not a zombie.

    A pid can be reused after its process dies; a reader that must be sure
    pairs this with a heartbeat age.
    """
    if pid <= 0:
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


# -- futex --------------------------------------------------------------------


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _PyBuffer(ctypes.Structure):
    # CPython's Py_buffer (stable since 3.3). ``obj`` is a void pointer so that
    # ctypes never touches its reference count; PyBuffer_Release does.
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [
    ctypes.c_long,
    ctypes.c_void_p,
    ctypes.c_long,
    ctypes.c_long,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_long,
]
_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


@contextmanager
def _pinned_address(buf: Any, offset: int):
    """The address of ``buf[offset]``, valid for the ``with`` block.

    The block holds a buffer export on ``buf``, as
    ``ctypes.c_uint32.from_buffer(mm, offset)`` would; while it is held,
    ``mmap.close()`` raises BufferError instead of unmapping memory the kernel
    may still be waiting on. We take the export through PyObject_GetBuffer
    rather than ``from_buffer`` because ``from_buffer`` refuses read-only
    mappings, and a reader in the state buffer's group maps it read-only.
    """
    view = _PyBuffer()
    _get_buffer(buf, ctypes.byref(view), 0)  # PyBUF_SIMPLE; raises if no buffer
    try:
        if offset < 0 or offset + 4 > view.len or offset % 4:
            raise ValueError(f"futex word at {offset} is not an aligned u32 inside the buffer")
        yield view.buf + offset
    finally:
        _release_buffer(ctypes.byref(view))


def futex_wait(buf: Any, offset: int, expected: int, timeout_s: float | None) -> bool:
    """Sleep while the u32 at ``buf[offset]`` equals ``expected``.

    True when woken, when the word already differed, or on a signal; False when
    ``timeout_s`` passed. Wake-ups can be spurious: callers re-read the word and
    wait again, as Python retries a system call a signal interrupted (PEP 475):
    a handler that only sets a flag does not end a wait, so pass a timeout.
    """
    ts = None
    if timeout_s is not None:
        timeout_s = max(0.0, timeout_s)
        ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    with _pinned_address(buf, offset) as addr:
        ret = _syscall(
            SYS_FUTEX,
            addr,
            FUTEX_WAIT,
            expected & 0xFFFFFFFF,
            ctypes.addressof(ts) if ts is not None else None,
            None,
            0,
        )
    if ret == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ETIMEDOUT:
        return False
    if err in (errno.EAGAIN, errno.EINTR):
        return True
    raise OSError(err, f"futex wait: {os.strerror(err)}")


def futex_wake(buf: Any, offset: int, n: int = INT_MAX) -> int:
    """Wake up to ``n`` processes waiting on the u32 at ``buf[offset]``; how many woke."""
    with _pinned_address(buf, offset) as addr:
        ret = _syscall(SYS_FUTEX, addr, FUTEX_WAKE, n, None, None, 0)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"futex wake: {os.strerror(err)}")
    return ret


# -- segments -----------------------------------------------------------------


class Segment:
    """One mapped segment. Close it when done; only the supervisor unlinks."""

    def __init__(self, name: str, mm: mmap.mmap, read_only: bool, reattached: bool = False):
        self.name = name
        self.mm = mm
        self.size = len(mm)
        self.read_only = read_only
        #: True when ``create_or_reattach`` found the segment a crash left behind.
        self.reattached = reattached

    @property
    def layout_version(self) -> int:
        return HEADER.unpack_from(self.mm, 0)[1]

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
) -> Segment:
    """Create ``name`` (it must not exist), map it and write the header.

    ``init`` fills the per-kind fields before the magic is written, so a
    process attaching meanwhile sees "not initialised yet", never half a header.
    With ``group``, the segment belongs to that group and is mode 0640.
    """
    if size < HEADER_SIZE:
        raise ValueError(f"segment size {size} is smaller than the header ({HEADER_SIZE})")
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
    except posix_ipc.ExistentialError:
        raise NodeError(
            f"{name} already exists; only the supervisor creates it (create_or_reattach)"
        ) from None
    try:
        _set_access(shm.fd, mode, group)
        os.ftruncate(shm.fd, size)
        mm = mmap.mmap(shm.fd, size)
    except BaseException:
        shm.close_fd()
        unlink(name)
        raise
    shm.close_fd()  # the mapping keeps the memory; the fd is not needed
    pid = os.getpid()
    HEADER.pack_into(mm, 0, b"\0\0\0\0", layout_version, pid, pid, size)
    if init is not None:
        init(mm)
    mm[0:4] = MAGIC
    return Segment(name, mm, read_only=False)


def attach(name: str, expected_layout: int, read_only: bool = False) -> Segment:
    """Map an existing segment; NodeNotRunning if absent, LayoutMismatch if foreign."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=read_only)
    except posix_ipc.ExistentialError:
        raise NodeNotRunning(
            f"{name} does not exist: no node of that name runs on this host"
        ) from None
    except posix_ipc.PermissionsError as exc:
        raise NodeError(f"{name}: permission denied ({exc}); is this user in its group?") from exc
    try:
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
    return Segment(name, mm, read_only=read_only)


def create_or_reattach(
    name: str,
    size: int,
    layout_version: int,
    mode: int = 0o600,
    group: str | int | None = None,
    init: Callable[[mmap.mmap], None] | None = None,
) -> Segment:
    """For the supervisor at start: reuse what a crash left, else start fresh.

    A segment with the same layout and size is reattached (``.reattached`` is
    True; its contents are kept, its owner and writer become this process);
    anything else under the name is unlinked and created anew.
    """
    try:
        seg = attach(name, layout_version)
    except (NodeNotRunning, LayoutMismatch):
        seg = None
    if seg is not None and seg.size == size:
        shm = posix_ipc.SharedMemory(name)
        try:
            _set_access(shm.fd, mode, group)
        finally:
            shm.close_fd()
        seg.set_owner_pid()
        seg.set_writer_pid()
        seg.reattached = True
        return seg
    if seg is not None:
        seg.close()
    unlink(name)
    return create(name, size, layout_version, mode=mode, group=group, init=init)


def unlink(name: str) -> bool:
    """Remove the name (supervisor only). Mappings elsewhere stay valid. False if absent."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True
