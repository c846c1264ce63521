"""The keeper's in-memory schedule: key → (due minute, class, version), and per
class the rows in due-minute order. This is the hot path: every change of the
feed goes through ``apply`` or ``remove``, the load walk through
``load_rows``, and the ready set is ``best`` (or ``best_columns``).

One class, ``Buckets`` (keeper/buckets/buckets.py), in one module a concern:

- ``table``: the slots, their columns and the key table (an open-addressing
  hash table), and how a row's order value enters its class's order;
- ``buckets``: ``Buckets`` itself: changes (``apply``, ``remove``), the
  load (``load_rows``), classes, ``reconfigure``;
- ``best``: the best K due rows (``best``, ``best_columns``; the C merge in
  keeper/_best.c);
- ``detach``: detached rows (leased, held, parked keys) and the granted
  keys remembered from the last ``best``;
- ``counts``: the per-class due counts and what queue-state reads
  (``counts``, ``coming``, ``lateness``, ``oldest_due``, ``came_due``).

Each concern's class derives from ``KeyTable`` (the state, set in one
``__init__``) and ``Buckets`` combines them: a method is looked up once a
type, so the split costs no call anything.

Hazards:

- Slots and table cells are not returned to the allocator: the columns keep
  their largest size (a freed slot is reused by the next insert;
  ``load_rows`` appends).
- Growing the hash table rehashes every row in Python (about 0.3 µs a row,
  once per doubling: a 200 ms pause when it passes 699,050 rows);
  ``reserve`` or ``capacity`` sizes it ahead of a load.
- Until the first read after a load, its order values take 8 more bytes a
  row (the pending runs); the keeper publishes while it loads, which merges
  them.
- ``items`` walks the live columns: do not apply or remove while iterating.
- Minutes must fit in int32 (due times 0 to year 3000 do) and a node holds
  fewer than 2**31 rows.
- A class whose rows are all detached is not empty: it is not retired to
  make room under max_classes.
"""

from keeper.buckets.best import Columns, _merge
from keeper.buckets.buckets import Buckets, WalkedRow
from keeper.buckets.table import _MINUTE_HALF, _SLOT_HALF, Entry, minute_of
from keeper.order import SLOT_BITS, SLOT_MASK

# ``keeper.buckets`` was one module: what other code imported from it. The
# tunables stay in their modules (a test patches ``keeper.buckets.best``'s).
__all__ = [
    "SLOT_BITS",
    "SLOT_MASK",
    "_MINUTE_HALF",
    "_SLOT_HALF",
    "Buckets",
    "Columns",
    "Entry",
    "WalkedRow",
    "_merge",
    "minute_of",
]
