"""The schedule's SQL statements that code outside node.store runs.

The C claim path (shm._claim.ClaimPath, shm/_claim_path.c) carries no SQL of
its own: workers/claim.py hands it these two texts. Both select the columns
shm/_claim_grant.c reads, in its order (route, cadence_s, sitemap, due_at,
payload, job, version); change them together.
"""

from __future__ import annotations

__all__ = ["CLAIM_ROW_SQL", "CLAIM_ROWS_SQL"]

# One key's row: ?1 is the key.
CLAIM_ROW_SQL = (
    "SELECT route, cadence_s, sitemap, due_at, payload, job, version FROM schedule WHERE key = ?1"
)

# A run of keys in one statement: ?1 is a JSON array of them, and each row
# comes with its key's index in the array (column 0), then the columns above.
# CROSS JOIN keeps the array the outer loop, so the rows come in the array's
# order and each seek reuses the open cursors: measured in Python's sqlite3
# (64 keys a run, the claim bench's schedule), 0.54 µs a key of SQLite's time
# against about 1 µs for a statement a key in the C path's profile, most of
# the difference the statement's reset and its cursors opened and closed each
# time.
CLAIM_ROWS_SQL = (
    "SELECT j.key, s.route, s.cadence_s, s.sitemap, s.due_at, s.payload, s.job, s.version"
    " FROM json_each(?1) AS j CROSS JOIN schedule AS s ON s.key = j.value"
)
