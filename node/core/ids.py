"""Result ids: integers below 2**53, so that every JSON reader holds them
exactly (a JavaScript number is a double). In a fleet the producing node's
number (1 to 255, its row on the node list: docs/fleet.md) is in the high
bits, so that an id names the node whose log holds its result and an ack
sent to any node can be routed to it; ids of a node outside a fleet (and
those a node made before it joined one) have 0 there.

Offset table of an id (bit 0 the lowest):

    bits 0..44   the node's own sequence (2**45, about 3.5e13 results a node)
    bits 45..52  the node's number (0: no fleet)
"""

from __future__ import annotations

ID_BITS = 53
NUMBER_BITS = 8
LOCAL_BITS = ID_BITS - NUMBER_BITS
MAX_NUMBER = (1 << NUMBER_BITS) - 1
MAX_ID = (1 << ID_BITS) - 1


def fleet_base(number: int) -> int:
    """The lowest id a node of ``number`` gives (its first is one above)."""
    if not 0 <= number <= MAX_NUMBER:
        raise ValueError(f"a node's number is 0 to {MAX_NUMBER}, not {number}")
    return number << LOCAL_BITS


def shown_ids(ids: list[int], most: int = 20) -> str:
    """Ids for a message: the first ``most``, then an ellipsis for the rest."""
    return ", ".join(map(str, ids[:most])) + (" …" if len(ids) > most else "")


def number_of(result_id: int) -> int:
    """The number of the node that made ``result_id`` (0: no fleet's)."""
    return result_id >> LOCAL_BITS
