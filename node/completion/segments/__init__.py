"""The completion log as append-only segment files: the default backend.

Directory layout (``<data-dir>/completion/`` by default)::

    000000000001.seg     segments, numbered in creation order; the newest is active
    000000000002.seg
    000000000001.leases  lease summary of a removed segment (while keep_retired_s lasts)
    checkpoint           counts of compacted segments (absent until the first removal)
    LOCK                 flock()ed by the one writer; holds its pid

``SegmentStore`` is one class, built in layers (a class each, no call
between them that a method lookup does not already make):

- ``format.py``: the bytes on disk (file names, headers, records of formats
  1 to 3, the checkpoint and lease summary files) and their codecs;
- ``files.py``: ``FileOps``, every file call, the disk-fault seam;
- ``writer.py``: ``SegmentWriter``, appends, rolls, fsyncs, reads of a
  pending result, and the files compaction writes;
- ``deferred.py``: ``DeferredScan``, the recovery scan's fast path for a
  mostly retired log (results staged undecoded, ``staging.py``);
- ``recovery.py``: ``SegmentRecovery``, reading the directory back after a
  restart or crash: the reference scan, torn tails, damage, summaries.
"""

from __future__ import annotations

from collections.abc import Sequence

from node.completion.segments.files import FileOps
from node.completion.segments.format import (
    CHECKPOINT_NAME,
    FORMAT_VERSION,
    FRAME,
    HEADER,
    K_ACK,
    K_DISCARD,
    K_RESULT,
    LOCK_NAME,
    MAGIC,
    READ_VERSIONS,
    RESULT_HEAD,
    decode_record,
    decode_result_record,
    encode_header,
    encode_result_record,
    encode_retire,
    read_segment_records,
    segment_name,
    summary_name,
)
from node.completion.segments.recovery import SegmentRecovery


class SegmentStore(SegmentRecovery):
    """The completion log in ``path``. One writer: ``recover()`` takes the
    directory's lock and keeps it until ``close()``."""


__all__: Sequence[str] = (
    "CHECKPOINT_NAME",
    "FORMAT_VERSION",
    "FRAME",
    "HEADER",
    "K_ACK",
    "K_DISCARD",
    "K_RESULT",
    "LOCK_NAME",
    "MAGIC",
    "READ_VERSIONS",
    "RESULT_HEAD",
    "FileOps",
    "SegmentStore",
    "decode_record",
    "decode_result_record",
    "encode_header",
    "encode_result_record",
    "encode_retire",
    "read_segment_records",
    "segment_name",
    "summary_name",
)
