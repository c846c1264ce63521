"""The hold policy: what a miss (a release, or an expiry the sweep found)
does to a key, and which keys the keeper leaves out of the ready set.

A key that misses is held for 2, 4, 8, ... lease lengths (capped at the
row's cadence) and parked, until an operator's unhold or a new write of the
row, once it has missed ``max_misses`` times in a row. A result clears its
misses (``LeaseTable.complete``).
"""

from __future__ import annotations

from shm.leases.protocol import HELD, IDLE, PARKED, Ended, _Record


def hold_s(misses: int, lease_s: float, cadence_s: float) -> float:
    """After ``misses`` misses in a row: 2, 4, 8, ... lease lengths, capped at the cadence."""
    return min(2.0 ** min(misses, 60) * lease_s, cadence_s)


def missed(rec: _Record, now: float, how: Ended, max_misses: int) -> tuple[_Record, int]:
    """The record after one more miss at ``now`` (ended ``how``), and the
    code to publish it with: HELD, or PARKED at ``max_misses``."""
    misses = rec.misses + 1
    held_until = now + hold_s(misses, rec.lease_s, rec.cadence_s)
    code = PARKED if misses >= max_misses else HELD
    return rec._replace(misses=misses, held_until=held_until, ended=how), code


def excludes(w: int, rec: _Record, now: float) -> bool:
    """Whether a keyed slot (word ``w``, current record ``rec``) keeps its key
    out of the ready set: leased, held until after ``now``, parked or mid-change."""
    code = w & 15
    if code == HELD:
        return rec.held_until > now
    return code != IDLE
