"""A stored row's values in and out, alike for the SQL stores (SQLite and
PostgreSQL keep the payload as compact JSON text and a row's columns in the
same order): a payload's JSON, a stored row's checks and its ``Row``."""

from __future__ import annotations

import json
from typing import Any

from node.core.rows import MAX_KEY_BYTES, Row, stored_key_is_valid, stored_row_is_valid
from node.store.base import BadRow


def encode_payload(payload: Any) -> str | None:
    if payload is None:
        return None
    return json.dumps(payload, separators=(",", ":"), allow_nan=False)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# JSON as the node writes it: ``NaN`` and ``Infinity`` are text Python's json
# reads, but no JSON answer may carry them, so a payload holding one is
# handed out as stored (its text), as any other that is not JSON. The claim
# path's C grant runs this decoder's scanner (workers/claim/path.py).
PAYLOAD_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def decode_payload(stored: Any) -> Any:
    """Parsed JSON; what another program stored that is not JSON comes back raw."""
    if stored is None:
        return None
    try:
        if isinstance(stored, bytes):  # a blob, or text that is not UTF-8: UTF-8 JSON or as it is
            return PAYLOAD_DECODER.decode(stored.decode())  # (json.loads would guess UTF-16)
        return PAYLOAD_DECODER.decode(stored)
    except (ValueError, TypeError):
        return stored


def bad_reason(key: Any, route: Any, cadence_s: Any, sitemap: Any, due_at: Any) -> str:
    if not stored_key_is_valid(key):
        return f"the key is not text of 1 to {MAX_KEY_BYTES:,} bytes: key={key!r:.80}"
    return (
        "stored values are not schedulable: "
        f"route={route!r} cadence_s={cadence_s!r} sitemap={sitemap!r} due_at={due_at!r}"
    )


def stored_row(stored: tuple) -> Row | BadRow:
    """A row as read (key, route, cadence_s, sitemap, due_at, payload, job,
    version and the three outcome columns), or a BadRow naming what is wrong."""
    key, route, cadence_s, sitemap, due_at, payload, job, version, rid, finished, error = stored
    if not (stored_key_is_valid(key) and stored_row_is_valid(route, cadence_s, sitemap, due_at)):
        return BadRow(key, version, bad_reason(key, route, cadence_s, sitemap, due_at))
    return Row(
        key, route, cadence_s, sitemap == 1, due_at, decode_payload(payload), job, version,
        rid, finished, error,
    )  # fmt: skip
