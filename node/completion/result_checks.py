"""What the completion log takes as a result: checked at append, before
anything of the batch is buffered, so that a bad result cannot fail every
later flush of the buffer it would sit in (``buffered.py`` calls these)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from node.completion.base import ENCODINGS, MAX_RECORD_BYTES, Result
from node.core.errors import ValidationError


def check_result(r: Result) -> None:
    """Refuse at append what could not be encoded at flush (a bad result
    would otherwise fail every later flush of the buffer it sits in)."""
    if not (
        isinstance(r.key, str)
        and isinstance(r.job, str)
        and isinstance(r.lease_id, (int, str))  # noqa: UP038 - a tuple is 3x faster here
        and isinstance(r.version, int)
        and isinstance(r.finished_at, (float, int))  # noqa: UP038
        and isinstance(r.cadence_s, (float, int))  # noqa: UP038
        and isinstance(r.data, bytes)
        and r.encoding in ENCODINGS
    ):
        raise ValidationError(
            "bad_result",
            "a result needs str key and job, int or str lease_id, int version, numeric "
            f"finished_at and cadence_s, bytes data and an encoding in {ENCODINGS}: {r!r:.200}",
            "result",
        )
    if len(r.data) + len(r.key) + len(r.job) + 256 > MAX_RECORD_BYTES:
        raise ValidationError(
            "result_too_large", f"a result is at most {MAX_RECORD_BYTES} bytes", "result"
        )


def plain_results(results: Sequence[Result]) -> bool:
    """The usual batch, told in one lean pass: every field of the exact type
    ``check_result`` wants and the record small. False sends the batch to
    ``check_result``, which says what is wrong (or passes it: an int
    finished_at, a str lease id, a subclass). In C when the extension is
    built (``_records.c``; ``_plain_results_py`` is its reference)."""
    c = _plain_c if _plain_c is not None else _bind_plain()
    if c is False:
        return _plain_results_py(results)
    return c(Result, results, _PLAIN_LIMIT)


# The record's room left for the data, the key and the job (as check_result).
_PLAIN_LIMIT = MAX_RECORD_BYTES - 256
# The C pass, bound at the first call: importing the segments package when
# this module is imported would be circular (it imports the log, which
# imports this). False: not built.
_plain_c: Any = None


def _bind_plain() -> Any:
    global _plain_c  # noqa: PLW0603 - bound once
    c: Any
    try:
        from node.completion.segments import _records
    except ImportError:  # pragma: no cover - a build without the extension
        c = False
    else:
        c = _records.plain_results
    _plain_c = c
    return c


def _plain_results_py(results: Sequence[Result]) -> bool:
    limit = _PLAIN_LIMIT
    for r in results:
        if not (
            r.key.__class__ is str
            and r.job.__class__ is str
            and r.lease_id.__class__ is int
            and r.version.__class__ is int
            and r.finished_at.__class__ is float
            and r.cadence_s.__class__ is float
            and r.data.__class__ is bytes
            and (r.encoding == ENCODINGS[0] or r.encoding == ENCODINGS[1])  # noqa: PLR1714
            and len(r.data) + len(r.key) + len(r.job) <= limit
        ):
            return False
    return True
