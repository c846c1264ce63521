"""Importing one file into a store: every line checked first (pass 1), then
the valid rows written in batches of ``BATCH_ROWS`` (pass 2)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.core.config import Config
from node.core.errors import StoreError, ValidationError
from node.core.rows import ORIGIN_NODE, RowWrite
from node.importer.base import (
    KEPT_ERRORS,
    Fill,
    ImportFailed,
    ImportReport,
    LineError,
)
from node.importer.formats import FORMATS, READERS, detect_format, read_rows
from node.store.base import Store
from workers.classes import ClassId, check_class_limit, needs_stored, write_classes

# One transaction per batch: large enough to amortise the commit, small enough
# that the keeper's change feed takes a batch in one read.
BATCH_ROWS = 5_000
# Progress lines on stderr for large files.
PROGRESS_EVERY = 100_000


def _batch_classes(store: Store, config: Config, writes: list[RowWrite]) -> set[ClassId]:
    return write_classes(config, writes, store.get_many(needs_stored(writes)))


def import_file(
    path: str | os.PathLike[str],
    store: Store,
    *,
    route: str | None = None,
    cadence_s: int | None = None,
    job: str | None = None,
    skip_invalid: bool = False,
    now: float | None = None,
    config: Config | None = None,
    known_classes: set[ClassId] | frozenset[ClassId] = frozenset(),
    reserve: Callable[[set[ClassId]], Any] | None = None,
    fmt: str | None = None,
    on_invalid: Callable[[LineError], None] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> ImportReport:
    """Import one file into ``store``; see the package docstring (``node.importer``).

    With invalid lines and no ``skip_invalid`` nothing is written and the
    report says how many (``imported`` 0). Raises ``ImportFileError`` for a
    file that cannot be read at all, ``TooManyClasses`` when the file would
    take the node past ``config.max_classes`` (counting ``known_classes``,
    the running keeper's; with ``reserve``, the running node's shared class
    table: the file's classes are reserved there instead, all or none),
    ``ImportFailed`` when the store fails part-way.
    """
    path = Path(path)
    config = config or Config()
    fill = Fill(route, cadence_s, job)
    fmt = fmt or detect_format(path)
    if fmt not in READERS:
        raise ValueError(f"format must be one of {FORMATS}, not {fmt!r}")
    report = ImportReport(str(path), fmt)
    run = _Run(path, fmt, fill, store, config, report, on_invalid, on_progress)
    classes = run.check()
    if report.invalid and not skip_invalid:
        return report
    if reserve is not None:
        reserve(classes)
    else:
        check_class_limit(set(known_classes), classes, config.max_classes, None)
    run.write(time.time() if now is None else now)
    return report


@dataclass
class _Run:
    """The two passes over one file."""

    path: Path
    fmt: str
    fill: Fill
    store: Store
    config: Config
    report: ImportReport
    on_invalid: Callable[[LineError], None] | None
    on_progress: Callable[[str], None] | None

    def say(self, message: str) -> None:
        if self.on_progress is not None:
            self.on_progress(message)

    def bad_line(self, line: int, exc: ValidationError) -> None:
        error = LineError(str(self.path), line, exc.code, exc.message, exc.field)
        self.report.invalid += 1
        if len(self.report.errors) < KEPT_ERRORS:
            self.report.errors.append(error)
        if self.on_invalid is not None:
            self.on_invalid(error)

    def check(self) -> set[ClassId]:
        """Pass 1: check every line; the classes the valid rows would make."""
        classes: set[ClassId] = set()
        chunk: list[RowWrite] = []
        for line, item in read_rows(self.path, self.fmt, self.fill):
            if isinstance(item, ValidationError):
                self.bad_line(line, item)
                continue
            self.report.valid += 1
            chunk.append(item)
            if len(chunk) >= BATCH_ROWS:
                classes |= _batch_classes(self.store, self.config, chunk)
                chunk = []
            if self.report.valid % PROGRESS_EVERY == 0:
                self.say(f"{self.path}: {self.report.valid:,} rows checked")
        if chunk:
            classes |= _batch_classes(self.store, self.config, chunk)
        return classes

    def write(self, now: float) -> None:
        """Pass 2: write the valid rows, one transaction per batch."""
        report = self.report
        batch: list[RowWrite] = []
        try:
            for _line, item in read_rows(self.path, self.fmt, self.fill):
                if isinstance(item, ValidationError):
                    continue
                batch.append(item)
                if len(batch) >= BATCH_ROWS:
                    report.imported += self.store.upsert(batch, now=now, origin=ORIGIN_NODE)
                    batch = []
                    if report.imported % PROGRESS_EVERY == 0:
                        done = f"{report.imported:,} of {report.valid:,}"
                        self.say(f"{self.path}: {done} rows imported")
            if batch:
                report.imported += self.store.upsert(batch, now=now, origin=ORIGIN_NODE)
        except StoreError as exc:
            raise ImportFailed(
                f"the store failed after {report.imported:,} rows were imported: {exc}", report
            ) from exc
