"""CSV files: a header row whose columns are named like row fields, and
typed cells (see the package docstring)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from node.core.config import parse_duration
from node.core.errors import ConfigError, ValidationError
from node.core.rows import ROW_FIELDS
from node.importer.base import Fill, ImportFileError, Item, strict_constant


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
        return json.loads(cell, parse_constant=strict_constant)
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


def read_csv(f: IO[bytes], path: Path, fill: Fill) -> Iterator[Item]:
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
