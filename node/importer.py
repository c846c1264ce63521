"""``python -m node import FILE``: load rows from JSON lines, CSV or a sitemap.

Formats (by extension, else by the first byte; ``.gz`` is read through):

- JSON lines (``.jsonl``, ``.ndjson``, ``.json``): one row object per line;
  ``--route``, ``--cadence`` and ``--job`` fill the fields a line leaves out.
- CSV (``.csv``) with a header row whose columns are named like row fields.
  Cells are typed: ``cadence_s`` seconds or a duration (``1h``) or ``null``,
  ``sitemap`` true/false/1/0/yes/no, ``due_at`` unix seconds, ``payload``
  JSON text. An empty cell leaves the field out.
- A sitemap (``.xml``): ``<urlset><url><loc>…</loc><changefreq>…</changefreq>``.
  ``loc`` is the key, ``changefreq`` the cadence (``CHANGEFREQ_S``; without
  one ``--cadence``, else the route's default), the sitemap flag is set, the
  route is ``--route`` or ``default``. A document with a DTD is refused: no
  entity is ever expanded (no billion laughs, no external entities).

All or nothing: every line is validated (with ``node.core.rows.parse_row``, as the
HTTP API does) before anything is written, so a file with one bad line imports
nothing and names every bad line. ``--skip-invalid`` imports the valid lines,
still names the others, and exits 0. The classes the file would create are
checked against ``max_classes`` in the same first pass. The file is read
twice (check, then write) so memory stays flat for a million rows; writes go
through ``store.upsert`` in batches of ``BATCH_ROWS``, one transaction each.
A store failure part-way leaves the earlier batches written (the summary
says how many).

Exit codes: 0 done (also with skipped lines), 2 bad arguments, an unreadable
or malformed file, invalid lines, or too many classes; 1 the store failed.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import os
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast
from xml.parsers import expat

from node.config import Config, load_config, parse_duration
from node.core.errors import ConfigError, NodeError, StoreError, ValidationError
from node.core.proc import RET_ERROR, RET_OK, RET_USAGE
from node.core.rows import (
    MAX_CADENCE_S,
    MIN_CADENCE_S,
    ORIGIN_NODE,
    ROW_FIELDS,
    RowWrite,
    check_job,
    check_route,
    parse_row,
)
from node.store.base import Store
from workers.classes import (
    ClassId,
    check_class_limit,
    classes_from_state,
    needs_stored,
    write_classes,
)

# One transaction per batch: large enough to amortise the commit, small enough
# that the keeper's change feed takes a batch in one read.
BATCH_ROWS = 5_000
# Progress lines on stderr for large files.
PROGRESS_EVERY = 100_000
# Bad lines kept in the report (all of them are passed to ``on_invalid``).
KEPT_ERRORS = 100
# Bytes fed to the XML parser at a time.
XML_CHUNK = 1 << 16

FORMATS = ("jsonl", "csv", "sitemap")
_EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".xml": "sitemap",
}

CHANGEFREQ_S = {
    "always": 3600,
    "hourly": 3600,
    "daily": 86400,
    "weekly": 604800,
    "monthly": 2592000,
    "yearly": 31536000,
    "never": 31536000,
}
SITEMAP_DEFAULT_ROUTE = "default"
SITEMAP_NS = "http://www.sitemaps.org/schemas/sitemap/0.9"

_UTF8_BOM = b"\xef\xbb\xbf"


class ImportFileError(NodeError):
    """The file as a whole cannot be read: unreadable, malformed XML, a DTD,
    a bad CSV header. The message starts with ``file:line:`` where known."""


class ImportFailed(NodeError):
    """The store failed part-way; ``report.imported`` rows were written."""

    def __init__(self, message: str, report: ImportReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True, slots=True)
class LineError:
    path: str
    line: int
    code: str
    message: str
    field: str | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message} [{self.code}]"


@dataclass
class ImportReport:
    path: str
    format: str
    valid: int = 0  # lines that make a valid row
    imported: int = 0  # rows written
    invalid: int = 0  # bad lines
    errors: list[LineError] = field(default_factory=list)  # the first KEPT_ERRORS

    def summary(self) -> dict[str, int]:
        return {"imported": self.imported, "invalid": self.invalid}


@dataclass(frozen=True, slots=True)
class _Fill:
    """What the command line fills into rows that leave a field out."""

    route: str | None = None
    cadence_s: int | None = None
    job: str | None = None

    def apply(self, obj: Any) -> Any:
        if isinstance(obj, dict):
            for name in ("route", "cadence_s", "job"):
                value = getattr(self, name)
                if value is not None and name not in obj:
                    obj[name] = value
        return obj


Item = tuple[int, Any]  # (line, a row object or a ValidationError)

# -- reading files ---------------------------------------------------------------------


def _open(path: Path) -> IO[bytes]:
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        if gzipped:
            return cast(IO[bytes], gzip.open(path, "rb"))
        return open(path, "rb")
    except OSError as exc:
        raise ImportFileError(f"{path}: cannot read: {exc.strerror or exc}") from None


@contextmanager
def _reading(path: Path) -> Iterator[IO[bytes]]:
    """``_open`` for the length of a read: a gzip file that is cut short or
    corrupt, or a read that fails part-way, refuses the file as a whole
    (exit 2) instead of escaping as a traceback. The first pass reads the
    whole file, so this is raised before anything is written."""
    try:
        with _open(path) as f:
            yield f
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ImportFileError(f"{path}: the gzip data is broken: {exc}") from None
    except OSError as exc:
        raise ImportFileError(f"{path}: cannot read: {exc.strerror or exc}") from None


def detect_format(path: Path) -> str:
    """By extension (``.gz`` stripped), else by the first non-blank byte."""
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    ext = os.path.splitext(name)[1]
    if ext in _EXTENSIONS:
        return _EXTENSIONS[ext]
    with _reading(path) as f:
        head = f.read(4096)
    head = head.removeprefix(_UTF8_BOM).lstrip()
    if head.startswith(b"<"):
        return "sitemap"
    if head.startswith(b"{"):
        return "jsonl"
    return "csv"


def _strict_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_lines(f: IO[bytes], path: Path, fill: _Fill) -> Iterator[Item]:
    for n, raw in enumerate(f, 1):
        if n == 1:
            raw = raw.removeprefix(_UTF8_BOM)
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"), parse_constant=_strict_constant)
        except UnicodeDecodeError:
            yield n, ValidationError("invalid_json", "the line is not valid UTF-8")
        except RecursionError:
            yield n, ValidationError("invalid_json", "the line nests too deeply")
        except ValueError as exc:
            yield n, ValidationError("invalid_json", f"not valid JSON: {exc}")
        else:
            yield n, fill.apply(obj)


# -- CSV ----------------------------------------------------------------------------


def _csv_cadence(cell: str) -> Any:
    if cell.strip().lower() == "null":
        return None
    try:
        seconds = parse_duration(cell, "cadence_s")
    except ConfigError as exc:
        raise ValidationError("invalid_cadence", str(exc), "cadence_s") from None
    return int(seconds) if seconds.is_integer() else seconds


def _csv_bool(cell: str) -> bool:
    value = cell.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise ValidationError(
        "invalid_sitemap", f"sitemap {cell!r} is not true/false/1/0/yes/no", "sitemap"
    )


def _csv_number(cell: str) -> float:
    try:
        return float(cell)
    except ValueError:
        raise ValidationError(
            "invalid_due_at", f"due_at {cell!r} is not unix seconds (a number)", "due_at"
        ) from None


def _csv_json(cell: str) -> Any:
    try:
        return json.loads(cell, parse_constant=_strict_constant)
    except (ValueError, RecursionError) as exc:
        raise ValidationError(
            "invalid_payload", f"payload is not JSON text: {exc}", "payload"
        ) from None


_CSV_COERCE: dict[str, Callable[[str], Any]] = {
    "cadence_s": _csv_cadence,
    "sitemap": _csv_bool,
    "due_at": _csv_number,
    "payload": _csv_json,
}


def _csv_header(reader: Any, path: Path) -> list[str] | None:
    try:
        header = next(reader)
    except StopIteration:
        return None
    header = [h.strip() for h in header]
    for h in header:
        if h not in ROW_FIELDS:
            raise ImportFileError(
                f"{path}:{reader.line_num}: unknown column {h!r}; columns are row fields: "
                + ", ".join(ROW_FIELDS)
            )
    if len(set(header)) != len(header):
        raise ImportFileError(f"{path}:{reader.line_num}: a column is named twice")
    if "key" not in header:
        raise ImportFileError(f"{path}:{reader.line_num}: the header has no key column")
    return header


def _csv_row(header: list[str], cells: list[str]) -> Any:
    if len(cells) != len(header):
        return ValidationError(
            "invalid_row", f"{len(cells)} cells; the header has {len(header)} columns"
        )
    obj: dict[str, Any] = {}
    try:
        for name, cell in zip(header, cells, strict=True):
            if cell == "":
                continue  # an empty cell leaves the field out
            coerce = _CSV_COERCE.get(name)
            obj[name] = coerce(cell) if coerce else cell
    except ValidationError as exc:
        return exc
    return obj


def _csv(f: IO[bytes], path: Path, fill: _Fill) -> Iterator[Item]:
    # A payload may be up to 1 MiB of JSON; csv's default field limit is 128 KiB.
    csv.field_size_limit(max(csv.field_size_limit(), 4 << 20))
    text = io.TextIOWrapper(f, encoding="utf-8-sig", newline="")
    reader = csv.reader(text)
    try:
        header = _csv_header(reader, path)
        if header is None:
            return
        for cells in reader:
            if not cells:
                continue  # a blank line
            item = _csv_row(header, cells)
            yield reader.line_num, fill.apply(item)
    except csv.Error as exc:
        raise ImportFileError(f"{path}:{reader.line_num}: not valid CSV: {exc}") from None
    except UnicodeDecodeError:
        raise ImportFileError(
            f"{path}:{reader.line_num + 1}: not valid UTF-8 (CSV files must be UTF-8)"
        ) from None
    finally:
        text.detach()


# -- sitemaps -----------------------------------------------------------------------


def _split_name(name: str) -> tuple[str, str]:
    """expat's ``uri}local`` (namespace_separator "}") into (uri, local)."""
    uri, sep, local = name.rpartition("}")
    return (uri, local) if sep else ("", name)


class _SitemapReader:
    """Streams ``<url>`` entries out of a urlset with expat (the parser under
    ElementTree, used directly for its line numbers). A DTD is refused where
    it starts, before any entity could be declared or expanded."""

    def __init__(self, path: Path, fill: _Fill) -> None:
        self.path = path
        self.fill = fill
        self.out: list[Item] = []
        self.depth = 0
        self.ns = ""
        self.in_url = False
        self.url_line = 0
        self.values: dict[str, str] = {}
        self.field: str | None = None
        self.text: list[str] = []
        p = expat.ParserCreate(namespace_separator="}")
        p.buffer_text = True
        p.StartElementHandler = self.start
        p.EndElementHandler = self.end
        p.CharacterDataHandler = self.data
        p.StartDoctypeDeclHandler = self.refuse_dtd
        p.EntityDeclHandler = self.refuse_dtd
        self.parser = p

    def refuse_dtd(self, *args: Any) -> None:
        raise ImportFileError(
            f"{self.path}:{self.parser.CurrentLineNumber}: the document has a DTD "
            "(<!DOCTYPE or <!ENTITY); sitemaps with DTDs are refused"
        )

    def start(self, name: str, attrs: Any) -> None:
        ns, local = _split_name(name)
        self.depth += 1
        line = self.parser.CurrentLineNumber
        if self.depth == 1:
            if local == "sitemapindex":
                raise ImportFileError(
                    f"{self.path}:{line}: this is a sitemap index; import each sitemap it lists"
                )
            if local != "urlset":
                raise ImportFileError(
                    f"{self.path}:{line}: the root element is <{local}>, not <urlset>"
                )
            self.ns = ns
        elif self.depth == 2 and local == "url" and ns == self.ns:
            self.in_url, self.url_line, self.values = True, line, {}
        elif self.depth == 3 and self.in_url and ns == self.ns and local in ("loc", "changefreq"):
            self.field, self.text = local, []

    def data(self, text: str) -> None:
        if self.field is not None:
            self.text.append(text)

    def end(self, name: str) -> None:
        if self.depth == 3 and self.field is not None:
            self.values.setdefault(self.field, "".join(self.text).strip())
            self.field = None
        elif self.depth == 2 and self.in_url:
            self.in_url = False
            self.out.append((self.url_line, self.entry(self.values)))
        self.depth -= 1

    def entry(self, values: dict[str, str]) -> Any:
        if "loc" not in values:
            return ValidationError("missing_field", "<url> has no <loc>", "loc")
        obj: dict[str, Any] = {
            "key": values["loc"],
            "route": self.fill.route or SITEMAP_DEFAULT_ROUTE,
            "sitemap": True,
            # No changefreq: --cadence, else the route's default (null).
            "cadence_s": self.fill.cadence_s,
        }
        if self.fill.job is not None:
            obj["job"] = self.fill.job
        freq = values.get("changefreq")
        if freq is not None:
            seconds = CHANGEFREQ_S.get(freq.lower())
            if seconds is None:
                return ValidationError(
                    "invalid_cadence",
                    f"unknown changefreq {freq!r}; allowed: " + ", ".join(CHANGEFREQ_S),
                    "changefreq",
                )
            obj["cadence_s"] = seconds
        return obj

    def feed(self, chunk: bytes, final: bool = False) -> list[Item]:
        try:
            self.parser.Parse(chunk, final)
        except expat.ExpatError as exc:
            raise ImportFileError(
                f"{self.path}:{exc.lineno}: not well-formed XML: {expat.ErrorString(exc.code)}"
            ) from None
        out, self.out = self.out, []
        return out


def _sitemap(f: IO[bytes], path: Path, fill: _Fill) -> Iterator[Item]:
    reader = _SitemapReader(path, fill)
    tail = b""
    first = True
    while True:
        chunk = f.read(XML_CHUNK)
        if first:
            first = False
            if chunk[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in chunk[:4]:
                raise ImportFileError(f"{path}: sitemaps must be UTF-8 (sitemaps.org)")
        # Belt and braces: refuse the markup outright, even where expat would
        # be given no chance to see it (the handlers above refuse it too).
        window = (tail + chunk).lower()
        if b"<!doctype" in window or b"<!entity" in window:
            raise ImportFileError(
                f"{path}: the document has a DTD (<!DOCTYPE or <!ENTITY); "
                "sitemaps with DTDs are refused"
            )
        tail = window[-16:]
        yield from reader.feed(chunk, final=not chunk)
        if not chunk:
            return


_READERS: dict[str, Callable[[IO[bytes], Path, _Fill], Iterator[Item]]] = {
    "jsonl": _json_lines,
    "csv": _csv,
    "sitemap": _sitemap,
}


def read_rows(
    path: Path, fmt: str, fill: _Fill
) -> Iterator[tuple[int, RowWrite | ValidationError]]:
    """Every row of the file with its line: a RowWrite, or why it is not one."""
    with _reading(path) as f:
        for line, item in _READERS[fmt](f, path, fill):
            if isinstance(item, ValidationError):
                yield line, item
                continue
            try:
                yield line, parse_row(item)
            except ValidationError as exc:
                yield line, exc
            except RecursionError:
                yield (
                    line,
                    ValidationError("invalid_payload", "payload nests too deeply", "payload"),
                )


# -- importing ----------------------------------------------------------------------


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
    fmt: str | None = None,
    on_invalid: Callable[[LineError], None] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> ImportReport:
    """Import one file into ``store``; see the module docstring.

    With invalid lines and no ``skip_invalid`` nothing is written and the
    report says how many (``imported`` 0). Raises ``ImportFileError`` for a
    file that cannot be read at all, ``TooManyClasses`` when the file would
    take the node past ``config.max_classes`` (counting ``known_classes``,
    the running keeper's), ``ImportFailed`` when the store fails part-way.
    """
    path = Path(path)
    config = config or Config()
    fill = _Fill(route, cadence_s, job)
    fmt = fmt or detect_format(path)
    if fmt not in _READERS:
        raise ValueError(f"format must be one of {FORMATS}, not {fmt!r}")
    report = ImportReport(str(path), fmt)
    run = _Run(path, fmt, fill, store, config, report, on_invalid, on_progress)
    classes = run.check()
    if report.invalid and not skip_invalid:
        return report
    check_class_limit(set(known_classes), classes, config.max_classes, None)
    run.write(time.time() if now is None else now)
    return report


@dataclass
class _Run:
    """The two passes over one file."""

    path: Path
    fmt: str
    fill: _Fill
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


# -- the command line ---------------------------------------------------------------


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


def _setup(args: argparse.Namespace) -> tuple[Config, _Fill, Path]:
    fill = _Fill(
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

    config, fill, path = _setup(args)

    def bad_line(error: LineError) -> None:
        print(error, file=sys.stderr)

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    with open_store(config.store_url) as store:
        report = import_file(
            path,
            store,
            route=fill.route,
            cadence_s=fill.cadence_s,
            job=fill.job,
            skip_invalid=args.skip_invalid,
            config=config,
            known_classes=_running_classes(config.name),
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


if __name__ == "__main__":
    sys.exit(main())
