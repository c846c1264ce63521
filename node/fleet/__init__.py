"""A fleet of nodes over one PostgreSQL database (docs/fleet.md): the node
list and its heartbeats (``membership``), the grant deadline a heartbeat
earns (``heartbeat``), the SQL (``queries``).

Below the keeper and above the stores in the import layers (pyproject.toml):
the keeper and the supervisor import it; it imports shared memory and the
core. Which node owns a key is ``keeper.owners.Ownership(live.names, me)``.
"""

from node.fleet.membership import (
    GRANT_MARGIN_FRACTION,
    MAX_SKEW_S,
    PEER_WAIT_S,
    Absent,
    Beat,
    FleetError,
    FleetFull,
    LiveList,
    Member,
    Membership,
    NotAMember,
    Skew,
    peers_seen,
)

__all__ = [
    "GRANT_MARGIN_FRACTION",
    "MAX_SKEW_S",
    "PEER_WAIT_S",
    "Absent",
    "Beat",
    "FleetError",
    "FleetFull",
    "LiveList",
    "Member",
    "Membership",
    "NotAMember",
    "Skew",
    "peers_seen",
]
