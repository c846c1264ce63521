"""Micro benchmarks (pytest-benchmark): the keeper's apply and best K, the
lease table's grant, the completion log's append and its recovery.

    python -m pytest bench/micro --benchmark-json=micro.json
    QN_MICRO_ROWS=1000000 QN_MICRO_RESULTS=1000000 python -m pytest bench/micro

Not collected by the default test run (pytest's testpaths is tests/); ``python
-m bench`` runs them and folds their figures into its results file. A
benchmark that times a loop of ``ops`` operations a round says so in
``extra_info["ops"]``, and the suite reports the time an operation.
"""

from __future__ import annotations

import os

import pytest

# Rows in the keeper's buckets (apply, best K); 1,000,000 is the design's top.
ROWS = int(os.environ.get("QN_MICRO_ROWS", "20000"))
# Results in the completion log that recovery reads back.
RESULTS = int(os.environ.get("QN_MICRO_RESULTS", "20000"))
OPS = 1000  # operations timed together in one round, where one is too short to time


@pytest.fixture(scope="session")
def rows() -> int:
    return ROWS


@pytest.fixture(scope="session")
def results() -> int:
    return RESULTS
