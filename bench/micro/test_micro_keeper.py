"""The keeper's buckets: one change applied, and the best K (5,000) read, over
``QN_MICRO_ROWS`` rows loaded as the keeper loads them (bench/bench_buckets.py's
rows: 100 classes, due times over 30 days, keys of about 55 characters)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.bench_buckets import CONFIG, NOW, change_stream, load_walk, row_columns
from bench.micro.conftest import OPS
from keeper.buckets import Buckets
from keeper.classes import ClassTable

ROUNDS = 60
K = 5000


@pytest.fixture(scope="module")
def buckets(rows: int) -> Any:
    loaded = Buckets(ClassTable(CONFIG))
    load_walk(loaded, rows, row_columns(rows))
    return loaded


def test_apply(benchmark: Any, buckets: Any, rows: int) -> None:
    """One change applied (a reschedule, a class change, an insert or a
    delete, as bench_buckets mixes them); ``OPS`` a round."""
    changes = iter(change_stream(rows, OPS * (ROUNDS + 2)))
    apply, remove = buckets.apply, buckets.remove

    def run() -> None:
        for _ in range(OPS):
            key, version, route, cadence_s, sitemap, due_at = next(changes)
            if route is None:
                remove(key)
            else:
                apply(key, version, route, cadence_s, sitemap, due_at)

    benchmark.extra_info.update(ops=OPS, rows=rows)
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)


def test_best_k(benchmark: Any, buckets: Any, rows: int) -> None:
    """The best 5,000 due keys, as the keeper picks them for a publish."""
    benchmark.extra_info.update(ops=1, rows=rows, k=K)
    got = benchmark(buckets.best, NOW, K)
    assert len(got) == min(K, buckets.counts(NOW)["due"]["total"])


def test_best_k_excluding_3000(benchmark: Any, buckets: Any, rows: int) -> None:
    """The best 5,000 with the 3,000 best passed over (keys out on lease)."""
    exclude = {entry[0] for entry in buckets.best(NOW, 3000)}
    benchmark.extra_info.update(ops=1, rows=rows, k=K, excluded=len(exclude))
    benchmark(buckets.best, NOW, K, exclude=exclude)
