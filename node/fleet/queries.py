"""The fleet's SQL, one name per query (membership: node/fleet/membership.py).

The node list is one table, ``fleet_nodes``. Every time in it is the
database's clock (``now()``): hosts' clocks differ, and only one clock may
judge whether a heartbeat is too old. A node's row outlives its membership:
a node that left or died keeps its name's row and its number (its result ids
carry that number in their high bits), and the same name revives it.

The table is made by the PostgreSQL store's versioned migrations
(``node/store/postgres_schema.py``, migration 2, under the store's advisory
lock): ``Membership`` runs them before it joins. A join takes
``pg_advisory_xact_lock(FLEET_LOCK_KEY)``: two joins at once would otherwise
pick the same lowest free number.
"""

from __future__ import annotations

from node.store.postgres_schema import FLEET_MAX_NUMBER

# The advisory lock that serialises joins: any constant the rest of a fleet's
# database does not use ("qnfleet" in ASCII).
FLEET_LOCK_KEY = 0x716E666C656574

# A node's number: 1 to MAX_NUMBER, unique in the fleet (0 is a node outside
# any fleet); the table's CHECK says the same.
MAX_NUMBER = FLEET_MAX_NUMBER

LOCK = "SELECT pg_advisory_xact_lock(%(lock)s)"

# Join, step 1: a name seen before takes its row back (and keeps its number).
REVIVE = """
UPDATE fleet_nodes
   SET address = %(address)s, started_at = now(), heartbeat_at = now(), left_at = NULL,
       applied_seq = NULL
 WHERE name = %(name)s
RETURNING number, extract(epoch FROM started_at)::float8
"""

# Join, step 2: a new name takes the lowest number no row holds.
LOWEST_FREE = f"""
SELECT min(n)::int FROM generate_series(1, {MAX_NUMBER}) AS n
 WHERE n NOT IN (SELECT number FROM fleet_nodes)
"""

INSERT = """
INSERT INTO fleet_nodes (name, address, number, started_at, heartbeat_at)
VALUES (%(name)s, %(address)s, %(number)s, now(), now())
RETURNING number, extract(epoch FROM started_at)::float8
"""

# One statement: the database's clock, and the heartbeat it replaced (to tell
# a node whether it had dropped out of the live list meanwhile). It carries
# the change-log position the node's keeper may resume from (NULL: unchanged).
HEARTBEAT = """
UPDATE fleet_nodes AS n
   SET heartbeat_at = now(), applied_seq = COALESCE(%(applied_seq)s, n.applied_seq)
  FROM (SELECT name, heartbeat_at FROM fleet_nodes WHERE name = %(name)s FOR UPDATE) AS before
 WHERE n.name = before.name AND n.left_at IS NULL
RETURNING extract(epoch FROM now())::float8, extract(epoch FROM before.heartbeat_at)::float8
"""

# The live list, judged by the database's clock alone.
LIVE = """
SELECT name, address, number, extract(epoch FROM started_at)::float8,
       extract(epoch FROM heartbeat_at)::float8, extract(epoch FROM now())::float8
  FROM fleet_nodes
 WHERE left_at IS NULL AND heartbeat_at > now() - make_interval(secs => %(timeout_s)s)
 ORDER BY name
"""

# The whole node list in one read, by name: each row's times, whether it is
# live (LIVE's test, to the letter) and when it left, with the database's
# clock. The cluster's answer takes its live nodes and the others from it.
LISTING = """
SELECT name, address, number, extract(epoch FROM started_at)::float8,
       extract(epoch FROM heartbeat_at)::float8, extract(epoch FROM now())::float8,
       left_at IS NULL AND heartbeat_at > now() - make_interval(secs => %(timeout_s)s),
       extract(epoch FROM left_at)::float8
  FROM fleet_nodes
 ORDER BY name
"""

# Every node on the list, live or not (a node down still holds the results
# its log keeps: an ack of one of its ids must say so, not lose it).
NODES = """
SELECT name, address, number,
       left_at IS NULL AND heartbeat_at > now() - make_interval(secs => %(timeout_s)s)
  FROM fleet_nodes
 ORDER BY number
"""

# How far the shared change log may be trimmed: the lowest position every
# live node reported, and whether a live node has reported none yet (it
# joined a moment ago: the log is kept whole until it does). Nodes that left
# or lapsed do not count: they load anew, or find their gap and walk.
TRIM_THROUGH = """
SELECT min(applied_seq)::bigint, bool_or(applied_seq IS NULL)
  FROM fleet_nodes
 WHERE (left_at IS NULL AND heartbeat_at > now() - make_interval(secs => %(timeout_s)s))
    OR heartbeat_at > now() - make_interval(secs => %(hold_s)s)
"""

# How far the log was trimmed (by any node): a node back from a lapse
# compares it with its feed's position (keeper/owned.py, ``rejoined``).
TRIMMED = "SELECT through FROM changes_trimmed"

NOW = "SELECT extract(epoch FROM now())::float8"

LEAVE = """
UPDATE fleet_nodes SET left_at = now() WHERE name = %(name)s AND left_at IS NULL
RETURNING name
"""

# A row that is no member (left, or silent past the timeout) frees its number.
FORGET = """
DELETE FROM fleet_nodes
 WHERE name = %(name)s
   AND (left_at IS NOT NULL OR heartbeat_at <= now() - make_interval(secs => %(timeout_s)s))
RETURNING name
"""
