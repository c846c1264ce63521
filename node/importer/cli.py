"""``python -m node import FILE``: the command line (the package docstring
says what it does)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from node.core.config import Config, load_config, parse_duration
from node.core.errors import ConfigError, StoreError, ValidationError
from node.core.proc import RET_ERROR, RET_OK, RET_USAGE
from node.core.rows import MAX_CADENCE_S, MIN_CADENCE_S, check_job, check_route
from node.importer.base import Fill, ImportFailed, ImportFileError, LineError
from node.importer.bulk import import_file
from node.importer.formats import FORMATS
from workers.classes import ClassId, classes_from_state


class _Usage(Exception):
    pass


class _Exit(Exception):
    def __init__(self, status: int) -> None:
        self.status = status


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so ``main`` returns a code and
    a usage error is one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Usage(message)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            print(message, file=sys.stderr, end="")
        raise _Exit(status)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m node import",
        description="Import rows from JSON lines, CSV (header row) or a sitemap.xml.",
    )
    p.add_argument("file", metavar="FILE")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--store", metavar="URL", help="store URL (default: the data dir's)")
    where.add_argument("--data-dir", metavar="DIR", help="the node's data directory")
    p.add_argument("--config", metavar="FILE", help="the node's TOML config (routes, max_classes)")
    p.add_argument("--name", help="the node to wake after the import (default: the host name)")
    p.add_argument("--route", help="route for rows that have none (sitemaps: default 'default')")
    p.add_argument("--cadence", metavar="DURATION", help="cadence for rows that have none: 1h, 7d…")
    p.add_argument("--job", help="job for rows that have none")
    p.add_argument("--format", choices=FORMATS, help="instead of guessing from the file")
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="import the valid lines, name the others, exit 0",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks on errors")
    return p


def _cadence_arg(text: str) -> int:
    seconds = parse_duration(text, "--cadence")
    if not seconds.is_integer() or not MIN_CADENCE_S <= seconds <= MAX_CADENCE_S:
        raise ConfigError(
            f"--cadence {text} is out of range: allowed {MIN_CADENCE_S} to {MAX_CADENCE_S} "
            "whole seconds (1m to 365d)"
        )
    return int(seconds)


def _running_classes(name: str) -> set[ClassId]:
    """The classes of a node running here, from its state buffer; empty when
    none runs (or the buffer cannot be read: the keeper refuses past the limit
    anyway)."""
    try:
        from shm.state import StateBuffer

        state = StateBuffer.attach(name)
        try:
            return classes_from_state(state.read())
        finally:
            state.close()
    except Exception:  # noqa: BLE001 - best effort, see docstring
        return set()


@contextlib.contextmanager
def _closing(table: Any) -> Iterator[None]:
    try:
        yield
    finally:
        if table is not None:
            table.close()


def _wake(name: str) -> None:
    """Nudge a running node's keeper; nothing happens when none runs."""
    try:
        from shm.wake import Wake

        wake = Wake.attach(name)
        try:
            wake.post()
        finally:
            wake.close()
    except Exception:  # noqa: BLE001 - best effort: the keeper polls its feed anyway
        pass


def _fail(message: str, code: int) -> int:
    print(f"queue-node import: {message}", file=sys.stderr)
    return code


def _setup(args: argparse.Namespace) -> tuple[Config, Fill, Path]:
    fill = Fill(
        route=None if args.route is None else check_route(args.route, "--route"),
        cadence_s=None if args.cadence is None else _cadence_arg(args.cadence),
        job=None if args.job is None else check_job(args.job, "--job"),
    )
    config = load_config(
        {"store": args.store, "data_dir": args.data_dir, "name": args.name, "config": args.config}
    )
    path = Path(args.file)
    if not path.is_file():
        raise ImportFileError(f"{path}: no such file")
    return config, fill, path


def main(argv: Sequence[str] | None = None) -> int:
    """The ``import`` command; ``argv`` is what follows ``import``. Returns
    the exit code (never calls sys.exit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except _Usage as exc:
        return _fail(str(exc), RET_USAGE)
    except _Exit as exc:
        return exc.status
    try:
        return _run(args)
    except (ConfigError, ValidationError, ImportFileError) as exc:
        if args.verbose:
            traceback.print_exc()
        return _fail(str(exc), RET_USAGE)
    except (ImportFailed, StoreError) as exc:
        if args.verbose:
            traceback.print_exc()
        if isinstance(exc, ImportFailed):
            print(json.dumps(exc.report.summary()), flush=True)
        return _fail(str(exc), RET_ERROR)


def _run(args: argparse.Namespace) -> int:
    from node.store import open_store
    from node.store.made import refuse_if_gone

    config, fill, path = _setup(args)

    def bad_line(error: LineError) -> None:
        print(error, file=sys.stderr)

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    from node.core.classes import carried
    from shm.classes import attach_or_none

    # A node running here: the file's classes are reserved in its shared
    # class table (shm/classes.py), as a write through the node's are.
    table = attach_or_none(config.name)
    reserve = None if table is None else (lambda cs: table.reserve(map(carried, cs)))
    # A store this data directory's node made and that is gone is not
    # made anew by an import (node/store/made.py).
    refuse_if_gone(config.store_url, Path(config.data_dir))
    with open_store(config.store_url, node_name=config.name) as store, _closing(table):
        report = import_file(
            path,
            store,
            route=fill.route,
            cadence_s=fill.cadence_s,
            job=fill.job,
            skip_invalid=args.skip_invalid,
            config=config,
            known_classes=set() if table is not None else _running_classes(config.name),
            reserve=reserve,
            fmt=args.format,
            on_invalid=bad_line,
            on_progress=progress,
        )
    if report.imported:
        _wake(config.name)
    print(json.dumps(report.summary()), flush=True)
    if report.invalid and not args.skip_invalid:
        return _fail(
            f"{report.invalid} invalid line(s); nothing imported "
            "(--skip-invalid imports the valid ones)",
            RET_USAGE,
        )
    if report.invalid:
        print(f"queue-node import: skipped {report.invalid} invalid line(s)", file=sys.stderr)
    return RET_OK
