"""What the lease table answers: a Lease or why not (Refused), how a
change went (Outcome), what the sweep found (Expired), what is held (Hold)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple


class Refuse(enum.Enum):
    LEASED = "leased"  # a lease on the key is live (or expired, not yet swept)
    HELD = "held"  # the key missed and its hold has not passed
    PARKED = "parked"  # max_misses misses in a row: until unhold or a new write
    FULL = "full"  # every slot is taken (counted in the header)
    BUSY = "busy"  # another process is changing this key's slot right now


@dataclass(frozen=True, slots=True)
class Refused:
    """What ``grant`` answers instead of a Lease. Falsy, like None."""

    reason: Refuse

    def __bool__(self) -> bool:
        return False


class Lease(NamedTuple):
    key: str
    lease_id: int
    consumer: str
    granted_at: float
    expires_at: float
    misses: int  # misses in a row before this lease
    version: int = 0  # the row's version when granted
    cadence_s: float = 0.0  # the row's cadence when granted


class Outcome(enum.Enum):
    COMPLETED = "completed"  # complete: the lease was live (or expired, unswept)
    LATE = "late"  # complete: it had expired or been released; not granted since
    REPEAT = "repeat"  # complete: this lease already ended with a result
    RELEASED = "released"  # release: a miss recorded
    RENEWED = "renewed"  # renew: expires_at = now + lease_s
    ENDED = "ended"  # release/renew: the lease is no longer live; nothing changed
    SUPERSEDED = "superseded"  # the key was granted to a newer lease since
    UNKNOWN = "unknown"  # the table has no such lease for this key
    BUSY = "busy"  # a live process kept the slot longer than BUSY_WAIT_S


class Expired(NamedTuple):
    key: str
    lease_id: int
    consumer: str
    expires_at: float
    misses: int
    held_until: float
    parked: bool


class Hold(NamedTuple):
    key: str
    lease_id: int
    misses: int
    held_until: float
    parked: bool
    last_error: str
