"""The recovery scan's fast path, for a log that is mostly retired.

Recovery cannot know whether a result is still pending until it has read
every retire record after it. Once a share of what it has read was retired
(``DEFER_DECODE_RETIRED``), ``_scan_fast`` checks each format-2 result
without decoding it, reads its id from the meta's fixed prefix, and stages
it (``node/completion/staging.py``); each retire pass takes the retired ones
out, and ``_index_staged`` decodes and indexes only the survivors. The
reference loop (``recovery.py``, ``_scan_run``) reads whatever this path
cannot take, and the whole log again when it meets something the writer
never writes (``_ReadAgain``). ``tests/integration/test_recovery_scan.py`` holds the two
paths to the same answer.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from array import array
from collections import Counter
from collections.abc import Sequence
from itertools import islice, repeat
from operator import gt, rshift

import msgpack  # type: ignore[import-untyped]

from node.completion.base import (
    MAX_RECORD_BYTES,
    RETIRE_ACK,
    RETIRE_DISCARD,
    CompletionConfig,
    RecoveryReport,
)
from node.completion.checkpoint import SegmentStats
from node.completion.pending import LOC_OFFSET_BITS
from node.completion.segments.files import FileOps
from node.completion.segments.format import (
    FRAME,
    HEAD_SIZE,
    K_ACK,
    K_DISCARD,
    K_RESULT,
    RESULT_HEAD,
    _unpack_meta,
    retire_time,
)
from node.completion.segments.writer import SegmentWriter
from node.completion.staging import Stage, StagedBatch

# What the recovery scan's fast path reads of a record, in one call:
#
#     offset  size  field
#     0       4     frame length, then crc (FRAME)
#     8       9     kind, meta length, head crc (RESULT_HEAD)
#     17      2     the meta's first two bytes as a u16 LE ("prefix"): 0x98
#                   (a msgpack array of 8) and the marker of the id, the
#                   array's first element
#     19      8     the 8 bytes after the marker, read as a u64 LE; byte-swapped
#                   in bulk they are the id's big-endian bytes
#
# So the scan has a result's id without decoding its meta, and decodes only
# the metas of results that are still pending at the end (``staging.py``).
FAST_HEAD = struct.Struct("<IIBIIHQ")
_ARRAY8 = 0x98
# Prefix, then the shortest meta that holds the whole id, for the two ids
# that are read in bulk: a msgpack uint 32 (ids up to 2^32 - 1) and uint 64.
PREFIX_U32, PREFIX_U64 = _ARRAY8 | 0xCE << 8, _ARRAY8 | 0xCF << 8
META_MIN_U32, META_MIN_U64 = 6, 10
# Any other msgpack uint id: its marker -> (shift of the swapped u64, shortest meta).
_UINT_ID = {0xCC: (56, 3), 0xCD: (48, 4), 0xCE: (32, 6), 0xCF: (0, 10)}
# Recovery checks results without decoding them, and decodes only the ones
# still pending once every record is read (staging.py), when at least this
# share of the results it has read so far was retired. Decoding as it goes
# is cheaper while most stay pending: decoding a survivor later costs more
# than decoding it at once (measured on the development VM: about even at a
# fifth to a quarter retired, half the time at half retired, 1.45 times the
# time when nothing is retired).
DEFER_DECODE_RETIRED = 0.25


class _ReadAgain(Exception):
    """The fast scan met a log the writer does not write (a result out of
    order, or one whose meta will not decode though its checksums hold):
    recovery reads the whole log again with the reference loop alone, which
    reports exactly what is wrong."""


class DeferredScan(SegmentWriter):
    """``_scan_fast`` and the stage it fills; ``SegmentRecovery`` drives it."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: CompletionConfig | None = None,
        file_ops: FileOps | None = None,
    ) -> None:
        self._stage = Stage()  # results a recovery checked, not yet indexed
        self._retired_read = 0  # ids in the retire records a recovery read
        self._fast_allowed = False  # whether this read of the log may use _scan_fast
        self._staged_any = False  # whether it has staged a result
        super().__init__(path, config, file_ops)

    def _defer_decode(self, report: RecoveryReport) -> bool:
        """Whether to scan the next segment with ``_scan_fast``: once a share
        of what was read has been retired (the first segment: never)."""
        return bool(report.results) and (
            self._retired_read >= DEFER_DECODE_RETIRED * report.results
        )

    def _scan_fast(  # noqa: C901 - the hot loop, inlined on purpose
        self,
        mm: mmap.mmap,
        buf: memoryview,
        off: int,
        size: int,
        stats: SegmentStats,
        report: RecoveryReport,
        whole: bool,
    ) -> int:
        """The hot loop of a mostly retired log: from ``off``, take every
        record up to the first one it cannot take as ``_scan_run`` would, and
        return that one's offset (``size`` at the end). It checks what
        ``_scan_run`` checks (lengths, the head crc, the body crc when
        ``whole``), but reads a result's id from its meta's fixed prefix
        (``FAST_HEAD``) and stages the result undecoded (``staging.py``).
        ACK and DISCARD records are decoded and noted as there. Anything
        else, and any record that fails a check, is left to ``_scan_run`` to
        read and report."""
        unpack = FAST_HEAD.unpack_from
        crc32 = zlib.crc32
        unpackb = msgpack.unpackb
        # Locals: the loop runs once a record.
        frame_size, head_size, result_head_size = FRAME.size, HEAD_SIZE, RESULT_HEAD.size
        max_bytes, k_result = MAX_RECORD_BYTES, K_RESULT
        last_id = self._index.last_id
        # Ids only grow: once above 2^32 - 1, every id is a uint 64.
        u64 = last_id >= 0xFFFFFFFF
        prefix, meta_min = (PREFIX_U64, META_MIN_U64) if u64 else (PREFIX_U32, META_MIN_U32)
        offsets: list[int] = []
        raws: list[int] = []
        odd: list[tuple[int, int, int]] = []  # (position, prefix, meta length): another id
        retires: list[tuple[int, str, Sequence[int], float | None]] = []  # offset, kind, ids, at
        add_offset, add_raw = offsets.append, raws.append
        limit = size - FAST_HEAD.size
        body = None
        try:
            while off <= limit:
                ln, crc, kind, meta_len, meta_crc, pre, raw = unpack(mm, off)
                end = off + frame_size + ln
                if kind == k_result:
                    # The meta within the record (a zero or short length fails
                    # that), the record within the file, and the head crc.
                    if meta_len + result_head_size > ln or end > size or ln > max_bytes:
                        break
                    if crc32(mm[off + head_size : off + head_size + meta_len], ln) != meta_crc:
                        break
                    if whole and crc32(buf[off + frame_size : end]) != crc:
                        break
                    if pre != prefix or meta_len < meta_min:
                        odd.append((len(offsets), pre, meta_len))
                    add_offset(off)
                    add_raw(raw)
                else:
                    if ln == 0 or ln > max_bytes or end > size:
                        break
                    body = buf[off + frame_size : end]
                    if crc32(body) != crc:
                        break
                    try:
                        rec = unpackb(body, use_list=False)
                        kind = rec[0]
                        if kind == K_ACK:
                            how = RETIRE_ACK
                        elif kind == K_DISCARD:
                            how = RETIRE_DISCARD
                        else:
                            break
                        retired = rec[1]
                        len(retired)
                        when = retire_time(rec)
                    except (
                        ValueError,
                        TypeError,
                        IndexError,
                        OverflowError,
                        msgpack.UnpackException,
                    ):
                        break
                    retires.append((off, how, retired, when))
                off = end
        finally:
            del body
        stop = off
        taken = len(offsets)
        if taken:
            swapped = array("Q", raws)
            swapped.byteswap()  # each the big-endian reading of its 8 bytes
            ids = swapped if u64 else array("Q", map(rshift, swapped, repeat(32)))
            for i, pre, meta_len in odd:
                marker = pre >> 8
                if pre & 0xFF != _ARRAY8:
                    taken = i
                    break
                if marker < 0x80:  # a positive fixint: the marker is the id
                    rid, need = marker, 2
                elif marker in _UINT_ID:
                    shift, need = _UINT_ID[marker]
                    rid = swapped[i] >> shift
                else:
                    taken = i
                    break
                if meta_len < need:
                    taken = i
                    break
                ids[i] = rid
            if taken and (ids[0] <= last_id or not all(map(gt, islice(ids, 1, taken), ids))):
                # Never from the writer. The reference loop tells a result
                # that is out of order from one that only seems to be, after
                # one with a checksummed meta that will not decode, which
                # it does not count: leave it all to the reference loop.
                raise _ReadAgain
            if taken < len(offsets):
                stop = offsets[taken]  # _scan_run reads and reports that one
            if taken:
                del ids[taken:]
                self._stage.add(
                    StagedBatch(stats.number, ids, array("Q", islice(offsets, taken)), mm)
                )
                self._index.last_id = ids[-1]
                self._staged_any = True
                stats.results += taken
                stats.live += taken
                report.results += taken
        noted = 0
        for where, how, retired, when in retires:
            if where >= stop:
                break
            self._loaded_retire(how, retired, stats.number, when)
            noted += 1
        report.records += taken + noted
        return stop

    # -- the stage: results checked, decoded once every retire record is known -------

    def _loaded_retire(
        self, kind: str, ids: Sequence[int], segment: int, at: float | None = None
    ) -> None:
        super()._loaded_retire(kind, ids, segment, at)
        self._retired_read += len(ids)

    def _loaded_count(self) -> int:
        return len(self._index) + len(self._stage)

    def _retire_loaded(self, retired: dict[int, bool], any_discard: bool) -> Counter:
        counts = self._stage.retire(retired, any_discard)
        counts.update(self._index.retire_bulk(retired, any_discard))
        return counts

    def _index_staged(self) -> None:
        """Decode the staged results and index them: at the end of recovery,
        or before ``_scan_run`` indexes a later result itself. The only
        place a staged result's meta is decoded."""
        index = self._index
        meta_len_at = RESULT_HEAD.unpack_from
        for batch in self._stage.take():
            mm = batch.source
            base = batch.number << LOC_OFFSET_BITS
            loaders: dict[str, tuple] = {}
            for rid, off in zip(batch.ids, batch.offsets, strict=True):
                # What _scan_run does with a format-2 RESULT, less the checks
                # _scan_fast made already.
                meta = off + HEAD_SIZE
                try:
                    _, job, key, _, _, finished_at, _, _ = _unpack_meta(
                        mm[meta : meta + meta_len_at(mm, off + FRAME.size)[1]]
                    )
                    finished_at += 0.0
                    load = loaders.get(job)
                    if load is None:
                        load = loaders[job] = index.loader(job)
                except (
                    ValueError,
                    TypeError,
                    IndexError,
                    OverflowError,
                    msgpack.UnpackException,
                ):
                    # Its checksums held, so a writer's bug, not rot; the
                    # reference loop would not have counted it, nor let its
                    # id order the ones after it.
                    raise _ReadAgain from None
                add_id, add_loc, add_fin, add_key, add_all, add_code, code = load
                add_id(rid)
                add_loc(base | off)
                add_fin(finished_at)
                add_key(key)
                add_all(rid)
                add_code(code)
        self._stage.close()
