"""The keeper through a real read error (EIO) from its store, tick by tick.

The store lives on an ext4 file system of its own (an image on a loop
device). ``EXT4_IOC_SHUTDOWN`` shuts that file system down: from then on
every read of it fails in the kernel with EIO (``pread64(...) = -1 EIO``,
as strace shows; SQLite reports it as ``disk I/O error`` or, for a WAL
frame, ``database disk image is malformed``), opening a file on it fails,
and nothing on it changes. Mounted again, the same file is back with every
commit that was synced before the shutdown. Device-mapper's ``error`` target
would do the same below the file system, but this kernel has no
device-mapper; the shutdown ioctl needs only loop devices and ext4.

What must hold: the keeper's failing read starts an outage (it does not
die into a full reload), it serves from its copy meanwhile, retries with
backoff, and once the file system is back it resumes the feed and ends
exact with the row written just before the error.

Needs root (mount, losetup) and ext4 on a loop device: skipped, with the
reason, where either is missing.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from keeper.outage import STORE_CHECK_S
from keeper.process import Keeper
from node.core.rows import RowWrite
from node.store import open_store
from tests.integration.test_keeper import NOW, _config, _keeper_view, _rows, _table
from tests.integration.test_keeper_outage import _until, segments  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(120)

# <linux/ext4.h>: _IOR('X', 125, __u32), and "flush the journal, then shut
# down" (what a committed transaction needs to be there after a remount).
EXT4_IOC_SHUTDOWN = 0x8004587D
EXT4_GOING_FLAGS_LOGFLUSH = 1
IMAGE_BYTES = 64 << 20


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


class Volume:
    """An ext4 image on a loop device, mounted at ``mnt``."""

    def __init__(self, base: Path) -> None:
        self.image = base / "volume.img"
        self.mnt = base / "mnt"
        self.loop: str | None = None

    def make(self) -> str | None:
        """Set it up; the reason when this host cannot."""
        if os.geteuid() != 0:
            return "needs root (losetup, mount)"
        for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        with open(self.image, "wb") as f:
            f.truncate(IMAGE_BYTES)
        made = _run("mkfs.ext4", "-q", "-F", str(self.image))
        if made.returncode != 0:
            return f"mkfs.ext4 failed: {made.stderr.strip()}"
        loop = _run("losetup", "-f", "--show", str(self.image))
        if loop.returncode != 0:
            return f"no loop device: {loop.stderr.strip()}"
        self.loop = loop.stdout.strip()
        self.mnt.mkdir()
        return self.mount()

    def mount(self) -> str | None:
        assert self.loop is not None
        done = _run("mount", "-t", "ext4", self.loop, str(self.mnt))
        return None if done.returncode == 0 else f"cannot mount ext4: {done.stderr.strip()}"

    def shut_down(self) -> None:
        """Every read of the file system fails with EIO from now on."""
        fd = os.open(self.mnt, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_LOGFLUSH))
        finally:
            os.close(fd)

    def remount(self) -> None:
        """Back: detached (lazily: the keeper's old descriptors point into
        it) and mounted again at the same place."""
        assert _run("umount", "-l", str(self.mnt)).returncode == 0
        reason = self.mount()
        assert reason is None, reason

    def remove(self) -> None:
        if self.mnt.exists():
            _run("umount", "-l", str(self.mnt))
        if self.loop is not None:
            _run("losetup", "-d", self.loop)


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Volume]:
    vol = Volume(tmp_path)
    try:
        reason = vol.make()
        if reason is not None:
            pytest.skip(f"no real EIO here: {reason}")
        yield vol
    finally:
        vol.remove()


def test_a_read_error_from_the_store_is_an_outage_not_a_reload(
    volume: Volume, segments, node_name: str, tmp_path: Path  # noqa: F811 - the fixture
) -> None:
    path = volume.mnt / "schedule.db"
    store = open_store(f"sqlite:///{path}")
    store.upsert(_rows(500), now=NOW)
    keeper = Keeper(_config(node_name, tmp_path), store, *segments)
    keeper.start(NOW)
    t = _until(keeper, NOW, lambda: keeper.status == "live" and keeper.exact, step=0.01)
    try:
        # Written by another connection just before the error, so the
        # keeper's next read of the change log must read the file (a page
        # it has cached would not fail).
        writer = open_store(f"sqlite:///{path}")
        writer.upsert([RowWrite(key="just-before", route="pages", due_at=NOW)], now=NOW)
        writer.close()
        volume.shut_down()
        t = _until(keeper, t, lambda: keeper._outage is not None)
        figures = keeper.stats.store
        assert figures["state"] == "unreachable" and figures["outages"] == 1, figures
        assert "SQLite store" in figures["error"], figures
        assert not keeper.exact and keeper.status == "live"  # serving its copy, not reloading
        # The ready set goes on from memory, and the retries with backoff.
        published = keeper.stats.publish["count"]
        t = _until(keeper, t, lambda: keeper.stats.publish["count"] >= published + 2)
        assert keeper.stats.store["attempts"] >= 3, keeper.stats.store
        assert keeper._outage is not None and keeper.stats.store["reloads"] == 0

        volume.remount()
        t = _until(keeper, t + STORE_CHECK_S, lambda: keeper.exact)
        figures = keeper.stats.store
        assert figures["state"] == "ok" and figures["last_verdict"] == "intact", figures
        assert keeper.buckets.get("just-before") is not None
        assert _keeper_view(keeper) == _table(keeper.store)
    finally:
        keeper.store.close()
