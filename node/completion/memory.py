"""The in-memory twin of the segment store, for unit tests of the ledger.

Same semantics as ``node.completion.segments``, down to what a test can see:
ids, the group-commit buffer (a result is pending only after ``flush()``),
``recover()`` as a restart (the buffer is lost, the durable records are
replayed), segments that roll over at ``segment_bytes`` (sizes estimated),
compaction with the same rule, a checkpoint and lease summaries. Nothing is
written anywhere.
``disk_full = True`` makes every commit fail with ``LogUnavailable``, as a
full disk does. ``tests/integration/test_completion.py`` holds the two together.
"""

from __future__ import annotations

from dataclasses import replace

from node.completion.base import (
    CompletionConfig,
    LeaseEntry,
    LogUnavailable,
    RecoveryReport,
    Result,
)
from node.completion.buffered import BufferedLog, _Retire
from node.completion.checkpoint import Checkpoint
from node.completion.pending import LOC_OFFSET_BITS

# Estimated bytes of a record, to roll over where the files would (roughly).
_RESULT_OVERHEAD = 64
_ID_BYTES = 9


class MemoryCompletionStore(BufferedLog):
    def __init__(self, config: CompletionConfig | None = None) -> None:
        # The "disk": what survives recover().
        self._disk: dict[int, list[tuple]] = {}  # segment -> records
        self._disk_first_id: dict[int, int] = {}
        self._disk_bytes: dict[int, int] = {}
        self._disk_checkpoint = Checkpoint()
        self._disk_summaries: dict[int, tuple[float, list[LeaseEntry]]] = {}
        self.disk_full = False
        super().__init__(config)

    def _write(
        self, results: list[tuple[int, Result]], retires: list[_Retire], first_id: int
    ) -> tuple[int, list[int]]:
        if self.disk_full:
            raise LogUnavailable("completion log: the (simulated) disk is full")
        total = sum(len(r.data) + len(r.key) + _RESULT_OVERHEAD for _, r in results)
        total += sum(len(rt.ids) * _ID_BYTES + _RESULT_OVERHEAD for rt in retires)
        if not self._active or (
            self._disk_bytes[self._active]
            and self._disk_bytes[self._active] + total > self.config.segment_bytes
        ):
            number = max(self._active, self._checkpoint.next_segment - 1) + 1
            self._disk[number] = []
            self._disk_first_id[number] = first_id
            self._disk_bytes[number] = 0
            self._add_segment(number, first_id)
        records = self._disk[self._active]
        offsets = []
        for rid, r in results:
            offsets.append(len(records))
            records.append(("result", replace(r, id=rid)))
        for rt in retires:
            records.append((rt.kind, tuple(rt.ids), rt.reason, rt.at))
        self._disk_bytes[self._active] += total
        return self._active, offsets

    def _load(self, report: RecoveryReport) -> None:
        self._checkpoint = self._disk_checkpoint
        for number in sorted(self._disk):
            stats = self._add_segment(number, self._disk_first_id[number])
            base = number << LOC_OFFSET_BITS
            for offset, rec in enumerate(self._disk[number]):
                if rec[0] == "result":
                    r = rec[1]
                    self._index.add(r.id, r.job, r.key, r.finished_at, base | offset)
                    stats.results += 1
                    stats.live += 1
                    report.results += 1
                else:
                    self._loaded_retire(rec[0], rec[1], number, rec[3] if len(rec) > 3 else None)
                report.records += 1
            report.segments += 1
            self._apply_loaded_retires(force=False)
        for number in list(self._disk_summaries):
            if self._checkpoint.covers(number) and number not in self._disk:
                self._kept[number] = self._disk_summaries[number][0]
            else:  # left by a "crash" before the checkpoint: the segment is the evidence
                del self._disk_summaries[number]

    def _read(self, result_id: int, segment: int, offset: int) -> Result:
        return self._disk[segment][offset][1]

    def _remove(self, segments: list[int], checkpoint: Checkpoint) -> None:
        if self.disk_full:
            raise LogUnavailable("completion log: the (simulated) disk is full")
        self._disk_checkpoint = checkpoint
        for number in segments:
            del self._disk[number], self._disk_first_id[number], self._disk_bytes[number]

    def _results_of(self, segment: int) -> list[LeaseEntry]:
        return [
            (r.id, r.lease_id, r.key) for kind, r, *_ in self._disk[segment] if kind == "result"
        ]

    def _keep(self, summaries: list[tuple[int, float, list[LeaseEntry]]]) -> None:
        if self.disk_full:
            raise LogUnavailable("completion log: the (simulated) disk is full")
        for number, at, entries in summaries:
            self._disk_summaries[number] = (at, list(entries))

    def _kept_entries(self, segment: int) -> list[LeaseEntry]:
        return list(self._disk_summaries[segment][1])

    def _drop_kept(self, segments: list[int]) -> None:
        for number in segments:
            self._disk_summaries.pop(number, None)

    def _close(self) -> None:
        pass

    def segment_numbers(self) -> list[int]:
        """The segments "on disk", oldest first."""
        return sorted(self._disk)
