"""The claim path: take due keys from the ready set and lease them
(``path.py``, ``Claimer``), the rules its interfaces share (``rules.py``:
the arguments' checks and the refusals, as the node's domain errors) and a
key's lease state for ``GET /rows?key=`` (``explain.py``). Its interfaces
are the HTTP workers (``workers/http/work.py``) and ``node.local.LocalClaimer``;
see "A claim" in ``docs/internals.md``.

The names below are where the rest of the node and the tests import them from.
"""

from node.core.errors import NotReady
from node.core.names import ledger_address
from node.core.rows import Grant
from workers.claim.explain import lease_view, why_not_granted
from workers.claim.path import LOW_WATER_FRACTION, Claimer, ClaimStats
from workers.claim.rules import (
    MAX_CLAIM,
    MAX_CONSUMER_BYTES,
    MAX_LEASE_S,
    check_claim,
    check_lease_id,
    check_lease_s,
    complete_outcome,
    decode_result,
    encode_result,
    ledger_error,
    refuse,
)

__all__ = [
    "LOW_WATER_FRACTION",
    "MAX_CLAIM",
    "MAX_CONSUMER_BYTES",
    "MAX_LEASE_S",
    "ClaimStats",
    "Claimer",
    "Grant",
    "NotReady",
    "check_claim",
    "check_lease_id",
    "check_lease_s",
    "complete_outcome",
    "decode_result",
    "encode_result",
    "lease_view",
    "ledger_address",
    "ledger_error",
    "refuse",
    "why_not_granted",
]
