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


The package, by concern: ``base`` (errors, the report, what the command line
fills in), ``formats`` (detecting a format, gzip, JSON lines, ``read_rows``),
``csvfile``, ``sitemap``, ``bulk`` (``import_file``: the check pass and the
batched write) and ``cli`` (``main``, the argument parser).
"""

from __future__ import annotations

from node.importer.base import (
    KEPT_ERRORS,
    Fill,
    ImportFailed,
    ImportFileError,
    ImportReport,
    Item,
    LineError,
)
from node.importer.bulk import BATCH_ROWS, PROGRESS_EVERY, import_file
from node.importer.cli import build_parser, main
from node.importer.formats import FORMATS, detect_format, read_rows
from node.importer.sitemap import CHANGEFREQ_S, SITEMAP_DEFAULT_ROUTE, SITEMAP_NS, XML_CHUNK

__all__ = [
    "BATCH_ROWS",
    "CHANGEFREQ_S",
    "FORMATS",
    "KEPT_ERRORS",
    "PROGRESS_EVERY",
    "SITEMAP_DEFAULT_ROUTE",
    "SITEMAP_NS",
    "XML_CHUNK",
    "Fill",
    "ImportFailed",
    "ImportFileError",
    "ImportReport",
    "Item",
    "LineError",
    "build_parser",
    "detect_format",
    "import_file",
    "main",
    "read_rows",
]
