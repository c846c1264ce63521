"""The rules the claim path's interfaces share: the HTTP workers
(``workers/http/work.py``) and ``node.local.LocalClaimer`` check a claim's,
a lease's and a result's arguments here, and read the lease table's and the
ledger's refusals here, so both answer alike.

Everything here raises the node's domain errors (``node.core.errors``):
``ValidationError`` for what a caller sent, ``LeaseConflict`` and
``WorkUnavailable`` for what the node refuses, each with the stable error
code of ``docs/api.md``. Each interface maps them to its own answer: the HTTP
workers to a status (``workers/http/errors.py``'s ``ERROR_CODES``),
``LocalClaimer`` to a ``ClientError``.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from node.core.errors import LeaseConflict, ValidationError, WorkRefused, WorkUnavailable
from node.core.rows import result_bytes
from shm.leases import Outcome

# Limits from the contract (the HTTP layer and LocalClaimer check them).
MAX_CLAIM = 10_000
MAX_LEASE_S = 86_400
MAX_CONSUMER_BYTES = 128


# -- arguments ----------------------------------------------------------------------------


def check_claim(max_n: Any, lease_s: Any, consumer: Any) -> tuple[int, float, str]:
    """Validate a claim's arguments (ValidationError naming the field)."""
    if isinstance(max_n, bool) or not isinstance(max_n, int) or not 1 <= max_n <= MAX_CLAIM:
        raise ValidationError("invalid_max", f"max must be an integer from 1 to {MAX_CLAIM}", "max")
    lease_s = check_lease_s(lease_s)
    if not isinstance(consumer, str) or not consumer:
        raise ValidationError("invalid_consumer", "consumer must be a non-empty string", "consumer")
    try:
        size = len(consumer.encode())
    except UnicodeEncodeError:
        raise ValidationError(
            "invalid_consumer", "consumer must be valid UTF-8", "consumer"
        ) from None
    if size > MAX_CONSUMER_BYTES:
        raise ValidationError(
            "invalid_consumer",
            f"consumer is {size} bytes; at most {MAX_CONSUMER_BYTES}",
            "consumer",
        )
    return max_n, lease_s, consumer


def check_lease_s(lease_s: Any) -> float:
    if (
        isinstance(lease_s, bool)
        or not isinstance(lease_s, int | float)
        or not 1 <= lease_s <= MAX_LEASE_S
    ):
        raise ValidationError(
            "invalid_lease_s", f"lease_s must be a number from 1 to {MAX_LEASE_S}", "lease_s"
        )
    return float(lease_s)


def check_lease_id(lease_id: Any) -> int:
    if isinstance(lease_id, bool) or not isinstance(lease_id, int) or not 0 < lease_id < 1 << 64:
        raise ValidationError(
            "invalid_lease_id", "lease_id must be the integer a claim answered", "lease_id"
        )
    return lease_id


# -- refusals -----------------------------------------------------------------------------

# Outcomes of renew/release that refuse, as (kind, code, message).
_REFUSALS: dict[Outcome, tuple[type[WorkRefused], str, str]] = {
    Outcome.ENDED: (
        LeaseConflict, "lease_ended", "the lease has ended (expired, released or completed)"
    ),
    Outcome.SUPERSEDED: (
        LeaseConflict, "lease_conflict", "the key was granted to another lease since"
    ),
    Outcome.UNKNOWN: (LeaseConflict, "lease_unknown", "no such lease for this key"),
    Outcome.BUSY: (
        WorkUnavailable, "lease_busy", "another process held the key's lease slot; retry"
    ),
}  # fmt: skip

# The ledger's complete statuses that refuse, as (kind, code, message).
COMPLETE_REFUSALS: dict[str, tuple[type[WorkRefused], str, str]] = {
    "conflict": (LeaseConflict, "lease_conflict", "the key was granted to another lease since"),
    "unknown": (LeaseConflict, "lease_unknown", "no such lease for this key"),
    "log_unavailable": (
        WorkUnavailable, "log_unavailable", "the completion log cannot take results; retry"
    ),
}  # fmt: skip


def ledger_error(code: str, message: str) -> WorkRefused | ValidationError:
    """An error the ledger answered, as the work path's error: its answers
    to the caller (ids never offered, a result too large, a log that cannot
    take results), and any other error as the ledger failing
    (``ledger_unavailable``: retry)."""
    if code == "never_offered":
        return LeaseConflict(code, message, "ids")
    if code == "result_too_large":
        return ValidationError(code, message)
    if code == "log_unavailable":
        return WorkUnavailable(code, message)
    return WorkUnavailable("ledger_unavailable", f"the ledger failed: {code}: {message}")


def refuse(outcome: Outcome, key: str) -> WorkRefused:
    """The refusal of a renew or release that did not renew or release."""
    kind, code, message = _REFUSALS.get(
        outcome, (LeaseConflict, "lease_unknown", f"unexpected outcome {outcome.value}")
    )
    return kind(code, f"{message} (key {key!r})", "lease_id")


def complete_outcome(item: dict[str, Any], key: str) -> int | None:
    """The result id of an accepted completion; raises the refusal otherwise."""
    status = str(item.get("status"))
    if status in ("ok", "repeat"):
        return item.get("id")
    kind, code, message = COMPLETE_REFUSALS.get(
        status, (WorkUnavailable, "ledger_unavailable", f"the ledger answered status {status!r}")
    )
    field = "lease_id" if kind is LeaseConflict else None
    raise kind(code, f"{message} (key {key!r})", field)


# -- results ------------------------------------------------------------------------------


def encode_result(body: dict[str, Any], from_msgpack: bool) -> tuple[bytes, str]:
    """A completion's result as the ledger takes it: (bytes, "json" | "bytes").

    JSON value → its JSON text; ``{"result": "<base64>", "encoding":
    "base64"}`` → the bytes; raw bytes (msgpack) → the bytes."""
    if "result" not in body:
        raise ValidationError("missing_field", "the body needs result", "result")
    result = body["result"]
    encoding = body.get("encoding", "json")
    if encoding == "base64":
        if not isinstance(result, str):
            raise ValidationError("invalid_result", "a base64 result must be a string", "result")
        try:
            return base64.b64decode(result, validate=True), "bytes"
        except (binascii.Error, ValueError):
            raise ValidationError(
                "invalid_result", "result is not valid base64", "result"
            ) from None
    if encoding != "json":
        raise ValidationError(
            "invalid_result", 'encoding must be "base64" or absent (a JSON value)', "encoding"
        )
    if isinstance(result, bytes | bytearray) and not from_msgpack:
        raise ValidationError("invalid_result", "bytes travel as base64 in JSON", "result")
    try:
        return result_bytes(result)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValidationError(
            "invalid_result", f"result is not a JSON value: {exc}", "result"
        ) from None


def decode_result(result: bytes, encoding: str) -> Any:
    """A stored result back as a value: JSON parsed, bytes as bytes."""
    if encoding == "json":
        return json.loads(result)
    return bytes(result)
