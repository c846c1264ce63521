"""The keeper's buckets: keeper/buckets/buckets.py (moved whole from
keeper/buckets.py; the next commit splits it by concern)."""

from keeper.buckets.buckets import *  # noqa: F403
from keeper.buckets.buckets import _MINUTE_HALF, _SLOT_HALF, _merge  # noqa: F401
