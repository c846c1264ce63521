"""The completion log (node/completion/segments/): a group of 64 results of
1 KiB appended and flushed, without fsync and with it (fsync="batch", what a
group commit waits for), and ``recover()`` of a log of ``QN_MICRO_RESULTS``
pending results (bench/bench_completion.py's recover, timed here alone)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.bench_completion import RESULT_BYTES, _build, _results
from node.completion.base import CompletionConfig
from node.completion.segments import SegmentStore

GROUP = 64


@pytest.fixture(params=["never", "batch"])
def store(request: Any, tmp_path: Path) -> Iterator[SegmentStore]:
    opened = SegmentStore(tmp_path / "completion", CompletionConfig(fsync=request.param))
    opened.recover()
    yield opened
    opened.close()


def test_append(benchmark: Any, store: SegmentStore) -> None:
    group = _results(0, GROUP, os.urandom(RESULT_BYTES), time.time())

    def run() -> None:
        store.append_results(group)
        store.flush()

    benchmark.extra_info.update(ops=GROUP, result_bytes=RESULT_BYTES)
    benchmark.pedantic(run, rounds=200, iterations=1, warmup_rounds=2)


def test_recovery(benchmark: Any, tmp_path: Path, results: int) -> None:
    path = tmp_path / "completion"
    _build(path, results, 1.0)

    def run() -> None:
        fresh = SegmentStore(path)
        report = fresh.recover()
        fresh.close()
        assert report.pending == results

    benchmark.extra_info.update(ops=results, result_bytes=RESULT_BYTES, pending=results)
    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
