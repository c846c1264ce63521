"""A fleet's settings (docs/fleet.md), checked with the rest of the
configuration (node/core/config.py) before anything starts.

``GRANT_MARGIN_FRACTION`` is defined here, once: node/fleet/membership.py
computes the grant deadline with it, and the configuration checks that the
heartbeat fits in the window it leaves.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from node.core.errors import ConfigError
from node.core.names import NAME_RE

# The grant deadline is this share of the membership timeout short of it (2 s
# at the default 10 s): the node stops granting that long before another node
# can count it out. It covers the time between a take's check and its grant
# (microseconds) and the monotonic clock's drift against the database's over
# one timeout (parts per million), and leaves a clear gap in which the node no
# longer grants but is still a member.
GRANT_MARGIN_FRACTION = 0.2

# A peer: HOST:PORT, or a node name.
PEER_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})|" + NAME_RE.pattern)


def parse_peers(value: Any) -> tuple[str, ...]:
    """``peers``: a list (TOML) or a comma-separated string (environment,
    flag) of node names or HOST:PORT addresses; ValueError otherwise."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(p, str) for p in items):
        raise ValueError("peers must be strings")
    peers = tuple(p.strip() for p in items if p.strip())
    if not all(PEER_RE.fullmatch(p) for p in peers):
        raise ValueError("a peer is not a node name or HOST:PORT")
    return peers


def check_fleet(
    membership_timeout_s: float, heartbeat_s: float, peers: Sequence[str], name: str
) -> None:
    """Two heartbeats must fit in the grant deadline's window, and a node
    is not its own peer."""
    window_s = membership_timeout_s * (1 - GRANT_MARGIN_FRACTION)
    if 2 * heartbeat_s > window_s:
        raise ConfigError(
            f"heartbeat_s = {heartbeat_s:g} is too long for membership_timeout_s = "
            f"{membership_timeout_s:g}: at most {window_s / 2:g} (two heartbeats must fit "
            f"in the grant deadline's window, {1 - GRANT_MARGIN_FRACTION:.0%} of the timeout)"
        )
    if name in peers:
        raise ConfigError(f"peers names this node ({name!r}): list the other nodes")
