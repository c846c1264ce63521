"""Rows of the schedule, the writes that make them, and the changes they leave.

These are the only shapes that cross the store interface. Validation of what
a caller sends lives here too, so the HTTP API, the importer and the Python
client refuse the same things with the same error codes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from node.core.errors import ClientError, ValidationError

MAX_KEY_BYTES = 1024
MAX_ROUTE_BYTES = 128
MIN_CADENCE_S = 60
MAX_CADENCE_S = 31_536_000
MAX_PAYLOAD_BYTES = 1 << 20
DEFAULT_JOB = "default"
JOB_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Due times outside this range are almost certainly a unit mistake
# (milliseconds, or a zero) and would land in a bucket no one ever reaches.
MIN_DUE_AT = 0.0
MAX_DUE_AT = 32_503_680_000.0  # year 3000

# A payload or result travels in JSON and in msgpack (every answer comes in
# either, as the request asks), so it must be a value both carry. JSON
# refuses what msgpack alone has (bytes, ext types); msgpack has no integer
# past 64 bits and no str with a lone surrogate. Packing finds out (a fifth
# to a twentieth of json.dumps's time for the same value).


def msgpack_problem(value: Any) -> str | None:
    """Why msgpack cannot carry ``value`` (a JSON value), or None."""
    import msgpack  # here: node.client, which imports this module, stays standard library

    try:
        msgpack.packb(value, use_bin_type=True)
    except OverflowError:
        return "an integer outside -2**63..2**64-1, which msgpack cannot carry"
    except UnicodeEncodeError:
        return "a lone surrogate in a string, which msgpack cannot carry"
    except (TypeError, ValueError) as exc:
        return f"what msgpack cannot carry ({exc})"
    return None


# Where a change came from; the change log records one of these so that the
# flow counts can tell a producer's write from a write-back of a next due time.
ORIGIN_NODE = "node"
ORIGIN_WRITEBACK = "writeback"
ORIGIN_EXTERNAL = "external"
ORIGINS = (ORIGIN_NODE, ORIGIN_WRITEBACK, ORIGIN_EXTERNAL)

OP_INSERT = "I"
OP_UPDATE = "U"
OP_DELETE = "D"

ROW_FIELDS = ("key", "route", "cadence_s", "sitemap", "due_at", "payload", "job")
_OPTIONAL_FIELDS = frozenset(("cadence_s", "sitemap", "due_at", "payload", "job"))


class _Missing:
    """Marks a field a write did not carry: an update leaves it as it is."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"

    def __bool__(self) -> bool:
        return False


MISSING: Any = _Missing()


@dataclass(slots=True)
class Row:
    """One row of the schedule table as the store holds it.

    Not frozen: a frozen dataclass costs about 1 µs more to build, and rows
    and changes are built by the million on the feed and claim paths. Treat
    them as values all the same."""

    key: str
    route: str
    cadence_s: int | None  # None: the route's default
    sitemap: bool
    due_at: float
    payload: Any
    job: str
    version: int
    # The outcome of the row's last lease, written back by the node and
    # read-only for writers: the id and finish time of its last result, and
    # the error of a lease that ended without one since (None after a result).
    last_result_id: int | None = None
    last_finished_at: float | None = None
    last_error: str | None = None

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "route": self.route,
            "cadence_s": self.cadence_s,
            "sitemap": self.sitemap,
            "due_at": self.due_at,
            "payload": self.payload,
            "job": self.job,
            "version": self.version,
            "last_result_id": self.last_result_id,
            "last_finished_at": self.last_finished_at,
            "last_error": self.last_error,
        }


@dataclass(slots=True, frozen=True)
class RowWrite:
    """An upsert of one row. Fields left MISSING keep their stored value on an
    update and take their default on an insert (cadence_s None, sitemap False,
    due_at now, payload None, job "default")."""

    key: str
    route: str
    cadence_s: int | None = MISSING
    sitemap: bool = MISSING
    due_at: float = MISSING
    payload: Any = MISSING
    job: str = MISSING

    def present(self) -> tuple[str, ...]:
        """The optional fields this write carries, in a fixed order."""
        return tuple(f for f in ROW_FIELDS[2:] if getattr(self, f) is not MISSING)


@dataclass(slots=True)
class Change:
    """One entry of the change log. ``seq`` is also the version the row has
    after this change (a delete's seq is the version of its tombstone).
    Row fields are None for a delete, and for a row whose stored values are
    not valid (written by another program): ``valid`` is False then."""

    seq: int
    op: str
    key: str
    origin: str
    route: str | None
    cadence_s: int | None
    sitemap: bool
    due_at: float | None
    at: float  # wall time the change was logged
    valid: bool = True


def _bad(code: str, message: str, field: str) -> ValidationError:
    return ValidationError(code, message, field)


def check_key(key: Any, field: str = "key") -> str:
    if not isinstance(key, str) or not key:
        raise _bad("invalid_key", "key must be a non-empty string", field)
    try:
        n = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise _bad("invalid_key", "key must be valid UTF-8", field) from None
    if n > MAX_KEY_BYTES:
        raise _bad("invalid_key", f"key is {n} bytes; at most {MAX_KEY_BYTES} allowed", field)
    return key


def check_route(route: Any, field: str = "route") -> str:
    if not isinstance(route, str) or not route:
        raise _bad("invalid_route", "route must be a non-empty string", field)
    try:
        n = len(route.encode("utf-8"))
    except UnicodeEncodeError:
        raise _bad("invalid_route", "route must be valid UTF-8", field) from None
    if n > MAX_ROUTE_BYTES:
        raise _bad("invalid_route", f"route is {n} bytes; at most {MAX_ROUTE_BYTES}", field)
    return route


def check_cadence(value: Any, field: str = "cadence_s") -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad("invalid_cadence", "cadence_s must be an integer number of seconds", field)
    if isinstance(value, float):
        if not value.is_integer():
            raise _bad("invalid_cadence", "cadence_s must be a whole number of seconds", field)
        value = int(value)
    if not MIN_CADENCE_S <= value <= MAX_CADENCE_S:
        raise _bad(
            "invalid_cadence",
            f"cadence_s {value} is out of range {MIN_CADENCE_S}..{MAX_CADENCE_S}",
            field,
        )
    return value


def check_due_at(value: Any, field: str = "due_at") -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad("invalid_due_at", "due_at must be unix seconds (a number)", field)
    value = float(value)
    if not math.isfinite(value) or not MIN_DUE_AT <= value <= MAX_DUE_AT:
        raise _bad("invalid_due_at", f"due_at {value} is out of range 0..{MAX_DUE_AT:.0f}", field)
    return value


# Job names seen valid, so that a claim checks its grants' jobs with a set
# lookup (another program may write any text, or a blob, into ``job``).
JOBS_SEEN: set[str] = set()
JOBS_SEEN_MAX = 4096


def not_jobs(jobs: set[Any]) -> set[Any]:
    """Those of ``jobs`` that are not job names (a result for such a row
    could be polled but never acked: every job in a path is checked)."""
    if jobs <= JOBS_SEEN:
        return set()
    bad = set()
    for job in jobs - JOBS_SEEN:
        if isinstance(job, str) and JOB_RE.fullmatch(job):
            if len(JOBS_SEEN) < JOBS_SEEN_MAX:
                JOBS_SEEN.add(job)
        else:
            bad.add(job)
    return bad


def check_job(value: Any, field: str = "job") -> str:
    if not isinstance(value, str) or not JOB_RE.fullmatch(value):
        raise _bad("invalid_job", "job must match [A-Za-z0-9._:-]{1,128}", field)
    return value


def check_payload(value: Any, field: str = "payload") -> Any:
    try:
        encoded = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _bad("invalid_payload", f"payload is not a JSON value: {exc}", field) from None
    if len(encoded.encode("utf-8")) > MAX_PAYLOAD_BYTES:
        raise _bad("payload_too_large", "payload is over 1 MiB encoded", field)
    if (problem := msgpack_problem(value)) is not None:
        raise _bad("invalid_payload", f"payload holds {problem}", field)
    return value


def parse_row(obj: Any, where: str = "") -> RowWrite:
    """Validate one row as a caller sent it (a JSON object) into a RowWrite.

    ``where`` prefixes field names in errors (``rows[3].cadence_s``).
    """
    if not isinstance(obj, dict):
        raise _bad("invalid_row", "a row must be a JSON object", where or "row")
    unknown = set(obj) - set(ROW_FIELDS)
    if unknown:
        name = sorted(unknown)[0]
        raise _bad("unknown_field", f"unknown row field {name!r}", f"{where}{name}")
    if "key" not in obj:
        raise _bad("missing_field", "a row needs a key", f"{where}key")
    if "route" not in obj:
        raise _bad("missing_field", "a row needs a route", f"{where}route")
    fields: dict[str, Any] = {
        "key": check_key(obj["key"], f"{where}key"),
        "route": check_route(obj["route"], f"{where}route"),
    }
    if "cadence_s" in obj:
        value = obj["cadence_s"]
        fields["cadence_s"] = None if value is None else check_cadence(value, f"{where}cadence_s")
    if "sitemap" in obj:
        if not isinstance(obj["sitemap"], bool):
            raise _bad("invalid_sitemap", "sitemap must be true or false", f"{where}sitemap")
        fields["sitemap"] = obj["sitemap"]
    if "due_at" in obj:
        fields["due_at"] = check_due_at(obj["due_at"], f"{where}due_at")
    if "payload" in obj:
        fields["payload"] = check_payload(obj["payload"], f"{where}payload")
    if "job" in obj:
        fields["job"] = check_job(obj["job"], f"{where}job")
    return RowWrite(**fields)


def stored_key_is_valid(key: Any) -> bool:
    """Whether a key read back from the table is one the node can hold, lease
    and name in an answer: text, not empty, at most MAX_KEY_BYTES in UTF-8
    (another program may store a blob, a number, an empty or a longer text)."""
    if type(key) is not str or key == "":
        return False
    if len(key) <= MAX_KEY_BYTES // 4:  # at most 4 bytes a character
        return True
    return len(key.encode("utf-8", "surrogatepass")) <= MAX_KEY_BYTES


def stored_row_is_valid(route: Any, cadence_s: Any, sitemap: Any, due_at: Any) -> bool:
    """Whether values read back from the table (possibly written by another
    program) describe a row the keeper can schedule."""
    if not isinstance(route, str) or not route:
        return False
    if cadence_s is not None and (
        isinstance(cadence_s, bool)
        or not isinstance(cadence_s, int)
        or not MIN_CADENCE_S <= cadence_s <= MAX_CADENCE_S
    ):
        return False
    if sitemap not in (0, 1, True, False):
        return False
    if isinstance(due_at, bool) or not isinstance(due_at, int | float):
        return False
    return math.isfinite(due_at) and MIN_DUE_AT <= due_at <= MAX_DUE_AT


class Grant(NamedTuple):
    """One lease granted by a claim: what the holder needs to do the work.
    The claim path (``workers.claim``) makes them, in C as in Python; both
    clients (``node.client.Client``, ``node.local.LocalClaimer``) return them."""

    lease_id: int
    key: str
    payload: Any
    job: str
    due_at: float
    expires_at: float
    route: str | None = None  # which handler an inference process runs it with
    misses: int = 0  # misses in a row before this lease (a poison item shows here)


COMPLETION_FIELDS = ("lease_id", "key", "result")


def completions(items: Any) -> list[tuple[Any, Any, Any]]:
    """``complete_many``'s items (``node.client.Client``, ``LocalClaimer``)
    as ``(lease_id, key, result)``: each a tuple (or list) of the three, or
    a dict of exactly those fields, as ``POST /complete`` takes an item.
    Anything else is ClientError 400 ``invalid_body`` naming the item, and
    nothing is sent."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, tuple | list) and len(item) == 3:
            out.append(tuple(item))
            continue
        if isinstance(item, dict) and set(item) == set(COMPLETION_FIELDS):
            out.append((item["lease_id"], item["key"], item["result"]))
            continue
        why = "is not (lease_id, key, result) nor {lease_id, key, result}"
        if isinstance(item, dict):
            extra = sorted(map(str, set(item) - set(COMPLETION_FIELDS)))
            missing = [f for f in COMPLETION_FIELDS if f not in item]
            why = f"has {extra[0]!r} (bytes go as the result itself)" if extra else (
                f"has no {missing[0]!r}")
        raise ClientError(400, "invalid_body", f"items[{i}] {why}", f"items[{i}]")
    return out


def result_bytes(value: Any) -> tuple[bytes, str]:
    """A result as the ledger stores it: bytes as ``(bytes, "bytes")``, any
    other value as its JSON text ``(bytes, "json")``. TypeError or ValueError
    for what JSON cannot carry. A handler's return value and a completion's
    result go through this one step."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value), "bytes"
    text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    if (problem := msgpack_problem(value)) is not None:
        raise ValueError(f"the result holds {problem}")
    return text.encode(), "json"
