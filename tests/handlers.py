"""Inference handlers for the tests: they record what they saw, fail on cue,
or block like a wedged device. Loaded by ``python -m workers.inference`` as
``tests.handlers:NAME`` (the node runs from the repository root).

Cues come from the environment the test gives the node:

- ``QN_TEST_RECORD_DIR``: where handlers write what they saw, one JSON file
  per event (``setup-<pid>.json``, ``batch-<pid>-<n>.json``,
  ``blocked-<pid>.json``);
- ``QN_TEST_POISON_KEY``: the key ``poison_item`` and ``poison_batch`` fail on;
- ``QN_TEST_BLOCK_FILE``: ``blocker`` takes this file (renames it, so only one
  process ever takes it) and then blocks on that batch until killed, or for
  ``QN_TEST_BLOCK_S`` seconds when that is set.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

# A blocked handler gives up after this, so a test that fails cannot leave a
# process behind for long.
BLOCK_LIMIT_S = 120.0
_seq = itertools.count(1)


def _record(kind: str, doc: dict[str, Any]) -> None:
    where = os.environ.get("QN_TEST_RECORD_DIR")
    if not where:
        return
    path = Path(where) / f"{kind}-{os.getpid()}-{next(_seq)}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _ok(item: dict[str, Any]) -> dict[str, Any]:
    return {"key": item["key"], "ok": True}


class Recorder:
    """Records the device it was set up with and what CUDA_VISIBLE_DEVICES
    said, then every batch (keys and routes)."""

    tag = "recorder"

    def setup(self, device: str) -> None:
        _record(
            "setup",
            {
                "pid": os.getpid(),
                "device": device,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "tag": self.tag,
            },
        )

    def __call__(self, items: list[dict[str, Any]]) -> list[Any]:
        _record(
            "batch",
            {
                "pid": os.getpid(),
                "tag": self.tag,
                "keys": [i["key"] for i in items],
                "routes": [i.get("route") for i in items],
            },
        )
        return [{"key": i["key"], "tag": self.tag} for i in items]


class RecorderB(Recorder):
    tag = "b"


def poison_item(items: list[dict[str, Any]]) -> list[Any]:
    """Fails the poison key alone: an exception instance as its result."""
    poison = os.environ.get("QN_TEST_POISON_KEY")
    return [
        ValueError(f"poison {item['key']}") if item["key"] == poison else _ok(item)
        for item in items
    ]


def poison_batch(items: list[dict[str, Any]]) -> list[Any]:
    """Raises, failing the whole batch, whenever the poison key is in it."""
    poison = os.environ.get("QN_TEST_POISON_KEY")
    keys = [item["key"] for item in items]
    _record("batch", {"pid": os.getpid(), "keys": keys})
    if poison in keys:
        raise RuntimeError(f"poison {poison} in batch")
    return [_ok(item) for item in items]


def blocker(items: list[dict[str, Any]]) -> list[Any]:
    """Blocks (a wedged device) on the first batch after it takes the block
    file, until the process is killed; every other batch succeeds."""
    block = os.environ.get("QN_TEST_BLOCK_FILE")
    if block:
        taken = f"{block}.taken-{os.getpid()}"
        try:
            os.rename(block, taken)
        except FileNotFoundError:
            pass
        else:
            _record("blocked", {"pid": os.getpid(), "keys": [i["key"] for i in items]})
            block_s = float(os.environ.get("QN_TEST_BLOCK_S") or BLOCK_LIMIT_S)
            deadline = time.monotonic() + min(block_s, BLOCK_LIMIT_S)
            while time.monotonic() < deadline:
                time.sleep(0.05)  # the simulated hang itself
    return [_ok(item) for item in items]


def wrong_count(items: list[dict[str, Any]]) -> list[Any]:
    return [_ok(item) for item in items][:-1]


def read_records(where: Path, kind: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(where.glob(f"{kind}-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out
