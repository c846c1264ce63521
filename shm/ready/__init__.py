"""The ready set: the best K due keys, published by the keeper, read by claimers.

``/queue-node.<name>.ready``, double-buffered under seqlocks. By concern:
``layout`` (the protocol, the offsets and record formats, and the check of the
C claim path's offsets against them at import), ``base`` (mapping, the active
slot, the switch to a pending set), ``publish`` (the keeper's side), ``take``
(the claimers' side, snapshots) and ``readyset`` (``ReadySet``, all of them).
"""

from __future__ import annotations

from shm.ready.layout import (
    ACTIVE_OFFSET,
    CHUNK,
    CLAIM_CURSOR,
    CURSOR_INDEX,
    ENTRY,
    ENTRY_FORMAT,
    ENTRY_SIZE,
    FIRST_SLOT,
    FLAG_ASCII,
    GENERATION_OFFSET,
    GRANT_UNTIL_OFFSET,
    KEY_BYTES_EXTRA,
    KEY_BYTES_PER_ENTRY,
    KIND,
    LAYOUT_VERSION,
    LOW_WATER,
    LOW_WATER_OFFSET,
    READ_RETRIES,
    READY_FIELDS,
    READY_FIELDS_OFFSET,
    RECORD,
    RECORD_TAG_MASK,
    RECORD_TAG_SHIFT,
    SLOT,
    SLOT_GENERATION,
    SLOT_HEADER_SIZE,
    U64,
    ReadyEntry,
    ReadySnapshot,
    heap_size_for,
    record_tag,
    segment_size_for,
)
from shm.ready.readyset import ReadySet
from shm.ready.take import _decode

__all__ = [
    "ACTIVE_OFFSET",
    "CHUNK",
    "CLAIM_CURSOR",
    "CURSOR_INDEX",
    "ENTRY",
    "ENTRY_FORMAT",
    "ENTRY_SIZE",
    "FIRST_SLOT",
    "FLAG_ASCII",
    "GENERATION_OFFSET",
    "GRANT_UNTIL_OFFSET",
    "KEY_BYTES_EXTRA",
    "KEY_BYTES_PER_ENTRY",
    "KIND",
    "LAYOUT_VERSION",
    "LOW_WATER",
    "LOW_WATER_OFFSET",
    "READ_RETRIES",
    "READY_FIELDS",
    "READY_FIELDS_OFFSET",
    "RECORD",
    "RECORD_TAG_MASK",
    "RECORD_TAG_SHIFT",
    "SLOT",
    "SLOT_GENERATION",
    "SLOT_HEADER_SIZE",
    "U64",
    "ReadyEntry",
    "ReadySet",
    "ReadySnapshot",
    "_decode",
    "heap_size_for",
    "record_tag",
    "segment_size_for",
]
