"""Connections to the fleet's database opened off the caller's thread.

A keeper heartbeats in its own loop (keeper/fleet.py), so a heartbeat that
has to reconnect blocks that loop for the connect: up to libpq's least
``connect_timeout``, 2 s, when the database does not answer. Worse, a
reconnect begun during a network cut sends its SYN into the cut, and the
kernel retries it only a second later, then three: a cut of 1.5 s could
leave the node without a heartbeat for more than the grant deadline's 3.2 s
(docs/reliability.md, "Found by the campaign", finding 4), so it stopped
granting without its membership lapsing.

``Dialer`` opens connections on short-lived threads instead: the caller
asks for one (``take``) and gets a connection a dial opened, or None at
once. A new dial starts when none has for ``every_s`` (at most ``most``
under way): after a cut heals, the first dial started after it connects in
one round trip, whatever the earlier ones still wait for. A dial that
connects once another connection was taken is kept for the next ``take``
(closed when it is not needed then).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

# A new dial starts when none has for this long (a keeper asks at each
# heartbeat: 0.2 s at the least, docs/fleet.md).
DIAL_EVERY_S = 0.15
# At most this many dials are under way at once (each ends by its connect
# timeout at the latest, 2 s; meanwhile the kernel retries each one's SYN).
DIAL_MOST = 6


class Dialer:
    """``connect()`` run on threads of its own; ``take`` hands out what
    they opened."""

    def __init__(
        self,
        connect: Callable[[], Any],
        every_s: float = DIAL_EVERY_S,
        most: int = DIAL_MOST,
        name: str = "fleet-dial",
    ) -> None:
        self._connect = connect
        self.every_s = every_s
        self.most = most
        self.name = name
        self._lock = threading.Lock()
        self._ready: list[Any] = []
        self._under_way = 0
        self._started_ns = -(2**62)
        self._closed = False
        self.dials = 0  # started, lifetime
        self.last_error: str | None = None  # the last dial's that failed

    @property
    def under_way(self) -> int:
        with self._lock:
            return self._under_way

    def take(self) -> Any | None:
        """A connection a dial opened (the newest; any older ones are
        closed), or None, and then a dial is started unless one started
        less than ``every_s`` ago or ``most`` are under way."""
        with self._lock:
            if self._closed:
                return None
            conn = self._ready.pop() if self._ready else None
            stale, self._ready = self._ready, []
            now_ns = time.monotonic_ns()
            start = (
                conn is None
                and self._under_way < self.most
                and now_ns - self._started_ns >= self.every_s * 1e9
            )
            if start:
                self._under_way += 1
                self._started_ns = now_ns
                self.dials += 1
        for old in stale:
            _close(old)
        if start:
            threading.Thread(target=self._dial, name=self.name, daemon=True).start()
        return conn

    def _dial(self) -> None:
        try:
            conn = self._connect()
        except Exception as exc:  # noqa: BLE001 - said by the next take's caller
            with self._lock:
                self._under_way -= 1
                self.last_error = str(exc)
            return
        with self._lock:
            self._under_way -= 1
            keep = not self._closed
            if keep:
                self._ready.append(conn)
        if not keep:
            _close(conn)

    def close(self) -> None:
        """No more dials; the connections opened and not taken are closed (a
        dial still under way closes its own when it ends)."""
        with self._lock:
            self._closed = True
            ready, self._ready = self._ready, []
        for conn in ready:
            _close(conn)


def _close(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001, S110 - a connection being thrown away
        pass
