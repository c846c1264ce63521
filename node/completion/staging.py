"""Results the recovery scan has checked but not decoded or indexed yet.

Recovery cannot know whether a result is still pending until it has read
every retire record after it, and those can be in any later segment. In a
log that is mostly acknowledged (what an idle compactor leaves), the scan of
the segment files (``segments/deferred.py``) therefore checks each result
without decoding it and stages it here; each retire pass takes the retired
ones out; only the ones left are decoded and indexed, once every record has
been read (or earlier, when the scan must index a later result itself). Most
results of such a log are never decoded, and never in the index.

A batch is one run of results of one segment, in id order, as parallel
arrays of ids (read from the meta's fixed prefix) and record offsets, with
the segment's ``mmap`` (``source``) to decode the survivors from. The stage
owns those maps: a retire pass closes a map as soon as no batch needs it,
and ``close()`` closes the rest.

The staged results are the tail of what the scan has read, in id order:
everything before them is in the index already.
"""

from __future__ import annotations

import mmap
from array import array
from collections import Counter
from itertools import compress, repeat
from operator import not_


class StagedBatch:
    __slots__ = ("number", "ids", "offsets", "source")

    def __init__(self, number: int, ids: array, offsets: array, source: mmap.mmap) -> None:
        self.number = number  # the segment they are in
        self.ids = ids
        self.offsets = offsets
        self.source = source


class Stage:
    def __init__(self) -> None:
        self.batches: list[StagedBatch] = []
        self.count = 0  # staged results, over all batches
        self._maps: dict[int, mmap.mmap] = {}  # segment -> its map, while a batch needs it

    def __len__(self) -> int:
        return self.count

    def add(self, batch: StagedBatch) -> None:
        self.batches.append(batch)
        self.count += len(batch.ids)

    def keep_map(self, number: int, source: mmap.mmap) -> bool:
        """Hold a segment's map while a batch needs it; False: none does, and
        the caller closes it."""
        if any(b.source is source for b in self.batches):
            self._maps[number] = source
            return True
        return False

    def retire(self, retired: dict[int, bool], any_discard: bool) -> Counter:
        """Take every staged id that is a key of ``retired`` (True for a
        discard) out of the stage. Returns a Counter of (segment, is_discard)
        over the ids taken, as ``PendingIndex.retire_bulk`` does."""
        counts: Counter = Counter()
        if not retired or not self.count:
            return counts
        hit_of = retired.__contains__
        kept = []
        for b in self.batches:
            hit = list(map(hit_of, b.ids))
            n = hit.count(True)
            if n:
                if any_discard:
                    kinds = map(retired.__getitem__, compress(b.ids, hit))
                    counts.update(zip(repeat(b.number), kinds))
                else:
                    counts[(b.number, False)] += n
                self.count -= n
                if n == len(hit):
                    continue
                keep = list(map(not_, hit))
                b.ids = array("Q", compress(b.ids, keep))
                b.offsets = array("Q", compress(b.offsets, keep))
            kept.append(b)
        self.batches = kept
        self._release()
        return counts

    def take(self) -> list[StagedBatch]:
        """Every batch, in id order, leaving the stage empty (the maps stay
        open until ``close``: the caller reads the batches from them)."""
        batches, self.batches, self.count = self.batches, [], 0
        return batches

    def _release(self) -> None:
        needed = {id(b.source) for b in self.batches}
        for number, source in list(self._maps.items()):
            if id(source) not in needed:
                del self._maps[number]
                source.close()

    def close(self) -> None:
        self.batches, self.count = [], 0
        self._release()
