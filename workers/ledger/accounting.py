"""The ledger's lifetime counters and the conservation law (``docs/accounting.md``).

Where each term is counted:

| term | counted by | where it lives |
|---|---|---|
| routed | ``grants`` of the lease table (every grant, by whichever claimer) | shared memory |
| expired | ``expired − late_expired`` (a late result moves one to finished) | shared memory |
| released | ``released − late_released`` | shared memory |
| refused | ``refused_full`` (grants the table had no slot for) | shared memory |
| in_flight | ``live_count()``: leases live now (expired, unswept included) | shared memory |
| finished | results made durable (RESULT records) | completion log |
| acknowledged, discarded | durable ACK / DISCARD records | completion log |
| awaiting_ack | the log's pending index, counted, not derived | completion log |
| received, withdrawn | occurrences that came due; those a write took out first | keeper |
| waiting | due rows no lease holds, at the keeper's snapshot | keeper |

The laws, exact at quiescence (no grant, completion, release or sweep in
progress, and the log flushed)::

    received + requeued = routed + waiting + withdrawn      (input)
    routed   = finished + expired + released + in_flight    (output)
    finished = acknowledged + discarded + awaiting_ack

with requeued = expired + released. The input law is checked on the
keeper's snapshot (its own terms and the lease table's, read together).

The lease-table counters survive the death of any process (shared memory)
and a clean shutdown (saved with the leases). A host reboot after a crash
loses shared memory: ``AccountingFile`` keeps a checkpoint of the table's
counters (the ledger writes it every ``CHECKPOINT_INTERVAL_S``), and
``restore`` continues from it when it finds the table's counters behind.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.core.errors import NodeError

FILE_NAME = "accounting.json"
FILE_FORMAT = "queue-node.accounting"
FILE_VERSION = 1
# How often the ledger checkpoints the table's counters: what a host reboot
# after a crash can lose (plus the leases live at the crash).
CHECKPOINT_INTERVAL_S = 1.0
# The lease table's counters the ledger keeps (shm.leases.COUNTERS).
TABLE_COUNTERS = (
    "grants",
    "released",
    "expired",
    "completed",
    "late_expired",
    "late_released",
    "refused_full",
)


class AccountingFileError(NodeError):
    """``accounting.json`` exists but cannot be read as one."""


@dataclass(frozen=True, slots=True)
class LogCounts:
    """The completion log's lifetime counts (``Counters``) and its pending index."""

    finished: int
    acknowledged: int
    discarded: int
    awaiting_ack: int


def build(
    table: Mapping[str, int],
    in_flight: int,
    log: LogCounts,
    since: float,
    keeper: Mapping[str, Any] | None = None,
    base: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The contract's ``/accounting`` object (plus ``discarded`` and the gaps).

    ``table`` is the lease table's counters with any restored base added
    (``AccountingFile.totals``). ``keeper`` is the ``counters`` object of
    the keeper's state document (``keeper/report.py``, ``_input_side``): its
    received, withdrawn and waiting, with the lease table's counters read at
    the same moment, so that the input law is checked on one snapshot even
    under load; ``base`` (``AccountingFile.base``) is added to those
    counters as it is to ``table``. None (no document yet, or one from a
    keeper still loading, or no keeper: the ledger alone): the input side is
    unknown, ``gaps.input`` is None and ``balanced`` judges the output side.
    """
    routed = table["grants"]
    expired = table["expired"] - table["late_expired"]
    released = table["released"] - table["late_released"]
    output_gap = routed - (log.finished + expired + released + in_flight)
    finished_gap = log.finished - (log.acknowledged + log.discarded + log.awaiting_ack)
    keeper = keeper or {}
    input_gap: int | None = None
    if "input_gap" in keeper:
        base = base or {}
        requeued_base = (
            base.get("expired", 0)
            - base.get("late_expired", 0)
            + base.get("released", 0)
            - base.get("late_released", 0)
        )
        input_gap = (
            int(keeper["received"])
            + int(keeper["requeued"])
            + requeued_base
            - int(keeper["routed"])
            - base.get("grants", 0)
            - int(keeper["waiting"])
            - int(keeper["withdrawn"])
        )
    return {
        "received": int(keeper.get("received") or 0),
        "requeued": expired + released,
        "routed": routed,
        "waiting": keeper.get("waiting"),
        "withdrawn": int(keeper.get("withdrawn") or 0),
        "finished": log.finished,
        "acknowledged": log.acknowledged,
        "discarded": log.discarded,
        "expired": expired,
        "released": released,
        "refused": table["refused_full"],
        "in_flight": in_flight,
        "awaiting_ack": log.awaiting_ack,
        "balanced": output_gap == 0 and finished_gap == 0 and not input_gap,
        "since": since,
        "gaps": {
            "input": input_gap,
            "input_bound": keeper.get("unapplied"),
            "input_edges": keeper.get("leased_writes"),
            "input_as_of": keeper.get("at"),
            "output": output_gap,
            "finished": finished_gap,
        },
    }


@dataclass
class AccountingFile:
    """``<data-dir>/accounting.json``: when this data directory first started
    (``since``), the last checkpoint of the lease table's counters, and the
    base added to them after a reboot lost the table.

    Written by the ledger only (tmp file, fsync, rename, directory fsync).
    """

    path: Path
    since: float
    checkpoint: dict[str, int] = field(default_factory=dict)  # totals at checkpoint_at
    checkpoint_at: float = 0.0
    base: dict[str, int] = field(default_factory=dict)
    restores: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def open(cls, data_dir: str | os.PathLike[str], now: float | None = None) -> AccountingFile:
        """Read the file, or start one (``since`` = now) on a first start."""
        path = Path(data_dir) / FILE_NAME
        try:
            raw = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            made = cls(path, time.time() if now is None else now)
            made.save()
            return made
        try:
            doc = json.loads(raw)
            if doc.get("format") != FILE_FORMAT or doc.get("version") != FILE_VERSION:
                raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
            return cls(
                path,
                float(doc["since"]),
                {k: int(v) for k, v in doc.get("checkpoint", {}).items()},
                float(doc.get("checkpoint_at", 0.0)),
                {k: int(v) for k, v in doc.get("base", {}).items()},
                list(doc.get("restores", [])),
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise AccountingFileError(f"{path} is not an accounting file: {exc}") from exc

    def totals(self, table: Mapping[str, int]) -> dict[str, int]:
        """The table's counters plus the restored base."""
        return {name: int(table.get(name, 0)) + self.base.get(name, 0) for name in TABLE_COUNTERS}

    def restore(self, table: Mapping[str, int], now: float) -> dict[str, int] | None:
        """At the ledger's start: if the table counts less than the last
        checkpoint, shared memory was lost (a host reboot after a crash) and
        the table started again from zero or from an older save. Raise the
        base so the totals continue from the checkpoint; returns what was
        added (None when the table was intact)."""
        if not self.checkpoint:
            return None
        totals = self.totals(table)
        added = {
            name: self.checkpoint[name] - totals[name]
            for name in TABLE_COUNTERS
            if self.checkpoint.get(name, 0) > totals[name]
        }
        if not added:
            return None
        for name, n in added.items():
            self.base[name] = self.base.get(name, 0) + n
        self.restores.append({"at": now, "added": added, "checkpoint_at": self.checkpoint_at})
        self.save()
        return added

    def save_checkpoint(self, table: Mapping[str, int], now: float) -> None:
        self.checkpoint = self.totals(table)
        self.checkpoint_at = now
        self.save()

    def save(self) -> None:
        doc = {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "since": self.since,
            "checkpoint": self.checkpoint,
            "checkpoint_at": self.checkpoint_at,
            "base": self.base,
            "restores": self.restores[-20:],
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
