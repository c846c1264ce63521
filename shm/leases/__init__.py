"""The lease table, moved from shm/leases.py to shm/leases/table.py as it
was (so that its history follows); the next commit splits it by concern.
Meanwhile every name is re-exported from here, as shm.leases had them."""

from shm.leases import table as _table

globals().update({k: v for k, v in vars(_table).items() if not k.startswith("__")})
