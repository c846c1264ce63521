"""Futexes on shared-memory words: ``futex_wait`` and ``futex_wake`` on a u32
of a mapping, through the raw syscall (ctypes), for processes that share the
segment (shm/segment.py's ``Segment.futex_wait`` and ``futex_wake``)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from contextlib import contextmanager
from typing import Any

INT_MAX = 0x7FFFFFFF

# The futex syscall's number differs by architecture (x86_64 202; aarch64 and
# the other asm-generic ones 98). The C extension has it from <sys/syscall.h>;
# this table stands in where the extension is not built.
_SYS_FUTEX_BY_MACHINE = {
    "x86_64": 202,
    "aarch64": 98,
    "arm64": 98,
    "riscv64": 98,
    "ppc64le": 221,
    "s390x": 238,
}


def _sys_futex() -> int:
    try:
        from shm import _atomic
    except ImportError:
        machine = platform.machine()
        if machine not in _SYS_FUTEX_BY_MACHINE:
            raise ImportError(
                f"the futex syscall number on {machine} is not known: build the C "
                "extension shm._atomic (`pip install -e .`), which reads it from "
                "<sys/syscall.h>"
            ) from None
        return _SYS_FUTEX_BY_MACHINE[machine]
    return _atomic.SYS_futex


# Futex ops. No FUTEX_PRIVATE_FLAG: the words are shared between processes,
# and private futexes only match within one process.
SYS_FUTEX = _sys_futex()
FUTEX_WAIT = 0
FUTEX_WAKE = 1


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
