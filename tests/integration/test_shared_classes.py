"""The shared class table (shm/classes.py): its CAS reservation, raced by
real processes, and its all-or-none rule."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.core.errors import TooManyClasses
from shm.classes import SharedClasses

ROOT = Path(__file__).resolve().parents[2]
SLOTS = 2_000

# One writer process: reserves the classes of its list one or two at a time,
# in its own order, and prints which calls won.
WRITER = """
import json, random, sys
from node.core.errors import TooManyClasses
from shm.classes import SharedClasses
name, seed, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
wanted = [("r", 60 * i, i % 2 == 0) for i in range(1, n + 1)]
random.Random(seed).shuffle(wanted)
won, lost = [], []
with SharedClasses.attach(name) as table:
    print("ready", flush=True)
    sys.stdin.readline()  # every writer starts at once
    i = 0
    while i < len(wanted):
        batch = wanted[i : i + 1 + (i % 2)]
        i += len(batch)
        try:
            table.reserve(batch)
            won.append(batch)
        except TooManyClasses:
            lost.append(batch)
print(json.dumps({"won": won, "lost": lost}))
"""


@pytest.fixture
def table() -> Iterator[SharedClasses]:
    name = f"t-{uuid.uuid4().hex[:12]}"
    made = SharedClasses.create(name, SLOTS)
    try:
        yield made
    finally:
        made.close()
        SharedClasses.unlink(name)


def _name(table: SharedClasses) -> str:
    return table.segment.name.split(".")[1]


def test_racing_processes_never_pass_the_limit_nor_duplicate(table: SharedClasses) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, _name(table), str(seed), str(SLOTS * 3 // 2)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for seed in range(4)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    held = table.classes()
    # 3,000 classes wanted, 2,000 slots: full, each class in one slot only
    assert table.used == SLOTS and len(held) == SLOTS
    for result in results:
        for batch in result["won"]:  # a reservation that won is in the table
            assert {(r, c, s) for r, c, s in batch} <= held
        for batch in result["lost"]:  # one that lost found no room for all of it
            assert not {(r, c, s) for r, c, s in batch} <= held


def test_a_reservation_is_all_or_none(table: SharedClasses) -> None:
    assert table.reserve([("r", 60 * i, False) for i in range(1, SLOTS)]) == SLOTS - 1
    with pytest.raises(TooManyClasses):
        table.reserve([("r", None, False), ("r", None, True)])
    assert table.used == SLOTS - 1
    assert table.reserve([("r", 60, False), ("r", None, True)]) == 1  # one is there
    assert table.used == SLOTS
    assert table.reserve([("r", 120, False)]) == 0  # known: passes when full
    # another process's mapping sees the same classes
    with SharedClasses.attach(_name(table)) as other:
        assert other.classes() == table.classes()
        with pytest.raises(TooManyClasses):
            other.reserve([("s", None, False)])
    table.set_limit(SLOTS + 8)  # never past the slots the table has
    assert table.limit == SLOTS
