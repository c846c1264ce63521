"""The node's HTTP listening socket: bound once by the supervisor and
inherited by every HTTP worker (``--listen-fd``), on TCP or a unix socket
file only its owner can connect to."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from node.core.config import Config
from node.core.errors import ConfigError


def bind_http(config: Config) -> socket.socket:
    """The node's listening socket, inherited by its HTTP workers."""
    if config.http_unix is not None:
        return bind_unix(config.http_unix)
    family = socket.AF_INET6 if ":" in config.http_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.http_host, config.http_port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {config.http}: {exc.strerror}") from None
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def bind_unix(path: Path) -> socket.socket:
    """``--http unix:PATH``: a socket file only its owner can connect to.

    The file is created mode 0600 (the umask is narrowed around ``bind``, so
    no other user can connect in between) in a directory this user owns:
    in a directory others may write to, another user could put their own
    socket there first. A socket file left by a crashed node (nothing
    accepts on it) is replaced; one something still serves on, or a path
    that is not a socket, is refused."""
    import stat

    where = f"cannot listen on unix:{path}"
    try:
        parent = os.stat(path.parent)
    except OSError as exc:
        raise ConfigError(f"{where}: its directory: {exc.strerror}") from None
    if parent.st_uid != os.geteuid():
        raise ConfigError(f"{where}: its directory {path.parent} is not owned by this user")
    try:
        existing = os.lstat(path)
    except FileNotFoundError:
        existing = None
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror}") from None
    if existing is not None:
        if not stat.S_ISSOCK(existing.st_mode):
            raise ConfigError(f"{where}: the path exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # stale: nothing accepts on it
        except OSError as exc:
            raise ConfigError(f"{where}: {exc.strerror or exc}") from None
        else:
            raise ConfigError(f"{where}: another process serves on this socket")
        finally:
            probe.close()
        path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    finally:
        os.umask(umask)
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def listening_address(sock: socket.socket) -> str:
    """node.json's ``http``: ``host:port``, or ``unix:PATH``."""
    if sock.family == socket.AF_UNIX:
        return "unix:" + sock.getsockname()
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"
