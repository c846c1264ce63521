"""A key's lease state and why a claim would not grant it now: the
``lease`` part of ``GET /rows?key=`` (``workers/http/work.py``)."""

from __future__ import annotations

from typing import Any

from shm.leases import LeaseTable


def lease_view(leases: LeaseTable, key: str, now: float) -> dict[str, Any]:
    """The lease table's view of one key: its live lease, or its hold or
    parking with misses, held_until and the last error."""
    found = leases.lookup(key)
    if found is None:
        return {"state": "none"}
    state, rec = found
    out: dict[str, Any] = {"state": state, "lease_id": rec.lease_id, "misses": rec.misses}
    if state == "leased":
        out.update(
            consumer=rec.consumer_str,
            granted_at=rec.granted_at,
            expires_at=rec.expires_at,
            expired=rec.expires_at <= now,
        )
    elif state in ("held", "parked"):
        out.update(held_until=rec.held_until, last_error=rec.error_str or None)
    return out


def why_not_granted(
    row: Any, lease: dict[str, Any], keeper: dict[str, Any] | None, now: float
) -> str | None:
    """Why a claim would not grant this row now; None when it would (as far
    as one look can tell)."""
    state = lease.get("state")
    if state == "leased" and not lease.get("expired"):
        return "leased"
    if state == "held" and lease.get("held_until", 0) > now:
        return f"held until {lease['held_until']}"
    if state == "parked":
        return "parked"
    if keeper and keeper.get("paused"):
        return "paused"
    if row is not None and getattr(row, "due_at", now) > now:
        return "not due"
    if keeper and keeper.get("held") and not keeper.get("in_ready_set"):
        return "not in the ready set"
    if keeper is not None and keeper.get("held") is False:
        return "not in the ready set"
    return None
