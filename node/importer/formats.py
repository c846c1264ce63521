"""Reading an import file: its format (by extension, else by its first byte),
gzip read through, JSON lines, and every line as a checked row
(``read_rows``). CSV and sitemaps have their own modules."""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, cast

from node.core.errors import ValidationError
from node.core.rows import RowWrite, parse_row
from node.importer.base import Fill, ImportFileError, Item, strict_constant
from node.importer.csvfile import read_csv
from node.importer.sitemap import read_sitemap

FORMATS = ("jsonl", "csv", "sitemap")
_EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".xml": "sitemap",
}

_UTF8_BOM = b"\xef\xbb\xbf"


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


def _json_lines(f: IO[bytes], path: Path, fill: Fill) -> Iterator[Item]:
    for n, raw in enumerate(f, 1):
        if n == 1:
            raw = raw.removeprefix(_UTF8_BOM)
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"), parse_constant=strict_constant)
        except UnicodeDecodeError:
            yield n, ValidationError("invalid_json", "the line is not valid UTF-8")
        except RecursionError:
            yield n, ValidationError("invalid_json", "the line nests too deeply")
        except ValueError as exc:
            yield n, ValidationError("invalid_json", f"not valid JSON: {exc}")
        else:
            yield n, fill.apply(obj)


READERS: dict[str, Callable[[IO[bytes], Path, Fill], Iterator[Item]]] = {
    "jsonl": _json_lines,
    "csv": read_csv,
    "sitemap": read_sitemap,
}


def read_rows(path: Path, fmt: str, fill: Fill) -> Iterator[tuple[int, RowWrite | ValidationError]]:
    """Every row of the file with its line: a RowWrite, or why it is not one."""
    with _reading(path) as f:
        for line, item in READERS[fmt](f, path, fill):
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
