"""Who a node is: its data directory's identity and this start's boot id.

The data directory's identity is 16 random bytes made once, when the node
first starts in that directory, and kept in ``<data-dir>/identity`` (32 hex
digits, mode 0600). Every shared-memory segment the node makes carries it
(shm/segment.py, the identity block), so a restarted node reattaches only
what its own data directory's node left, never a segment another user or
another node made under the same name.

The boot id is 16 random bytes made at every start of the supervisor and
stamped into every segment: a process attached to the node (a LocalClaimer)
tells by it that the node it attached to has restarted.
"""

from __future__ import annotations

import os
from pathlib import Path

from node.core.errors import ConfigError

FILE_NAME = "identity"
ID_BYTES = 16


def data_dir_id(data_dir: str | os.PathLike[str], create: bool = False) -> bytes:
    """The identity of ``data_dir``, made now when ``create`` and it has none.

    ConfigError when it is missing (and not ``create``) or unreadable: a data
    directory whose identity changed would no longer own its segments."""
    path = Path(data_dir) / FILE_NAME
    if create and not path.exists():
        _make(path)
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: has a node ever run in {data_dir}?") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    try:
        ident = bytes.fromhex(text)
    except ValueError:
        ident = b""
    if len(ident) != ID_BYTES:
        raise ConfigError(
            f"{path} is not {ID_BYTES * 2} hex digits; restore it or remove the "
            "node's segments ('python -m node clear NAME') before removing it"
        )
    return ident


def _make(path: Path) -> None:
    """Write a new identity whole, then link it in place: a kill at any
    instruction leaves either no identity or a complete one (never an empty
    file), and of two starts racing only one identity wins."""
    tmp = path.with_name(f"{FILE_NAME}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(os.urandom(ID_BYTES).hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another start made it first: theirs stands
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)


def new_boot_id() -> bytes:
    return os.urandom(ID_BYTES)
