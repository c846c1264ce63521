"""The lease table's grant (shm/leases/): a lease granted on a key that has
its idle slot, then completed, as a claimer and the ledger do; ``OPS`` a round."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from bench.micro.conftest import OPS
from shm.leases import LeaseTable, Refused

KEYS = 20_000
KEY = "https://example.com/items/{:010d}/some-slug-text"


@pytest.fixture(scope="module")
def table() -> Iterator[Any]:
    name = f"micro-{uuid.uuid4().hex[:8]}"
    leases = LeaseTable.create(name, capacity=65_536)
    try:
        now = time.time()
        for i in range(KEYS):  # every key gets its idle slot first
            lease = leases.grant(KEY.format(i), "micro", 60, now, 3600)
            leases.complete(KEY.format(i), lease.lease_id, now)
        yield leases
    finally:
        leases.close()
        LeaseTable.unlink(name)


def test_grant(benchmark: Any, table: Any) -> None:
    keys = [KEY.format(i) for i in range(KEYS)]
    at = [0]

    def run() -> None:
        now = time.time()
        grant, complete = table.grant, table.complete
        base = at[0]
        for j in range(OPS):
            key = keys[(base + j) % KEYS]
            lease = grant(key, "micro", 60, now, 3600)
            assert not isinstance(lease, Refused)
            complete(key, lease.lease_id, now)
        at[0] = base + OPS

    benchmark.extra_info.update(ops=OPS, keys=KEYS, what="grant and complete")
    benchmark.pedantic(run, rounds=50, iterations=1, warmup_rounds=1)
