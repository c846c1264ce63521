"""A fleet node's number, for the high bits of its result ids
(node/core/ids.py; docs/fleet.md, "Results from the whole fleet").

The keeper joins the node list and learns the number (its row keeps it for
the node's name while the row exists); the ledger reads it from the keeper's
state buffer (``trust.membership.number``) and keeps it in the data
directory (``fleet.json``), so that a restart gives ids above the same base
before the keeper has joined again, and a node whose database is away still
completes the leases it holds. A node outside a fleet has no number: its ids
carry 0 there.

No result can be made before the first join: a claim is granted only from a
set the keeper published, after it joined. A completion that comes before the
number is known (a lease from a data directory that never joined a fleet) is
refused with a retry (``not_joined``), never given an id without its node.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from node.core import log
from node.core.config import Config
from node.core.ids import MAX_NUMBER, fleet_base, number_of
from node.store import is_fleet_url

FILE = "fleet.json"


class FleetNumber:
    """The number this node's ids carry; None outside a fleet or until known."""

    def __init__(self, config: Config) -> None:
        self.name = config.name
        self.in_fleet = is_fleet_url(config.store_url)
        self.path = Path(config.data_dir) / FILE
        # The last id given before the number (ids of the node's time
        # outside a fleet, if any): the ids between it and the number's base
        # were never given, and an ack of one is refused as never offered.
        self.before = 0
        self.number: int | None = self._read() if self.in_fleet else None

    @property
    def missing(self) -> bool:
        """A fleet node whose number is not known yet."""
        return self.in_fleet and self.number is None

    def first_id(self) -> int:
        """The lowest id this node may give (1 outside a fleet)."""
        return 1 if self.number is None else fleet_base(self.number) + 1

    def _read(self) -> int | None:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warn("fleet_number_unreadable", path=str(self.path), error=str(exc))
            return None
        if not isinstance(doc, dict) or doc.get("name") != self.name:
            return None  # another node's directory: learnt again
        number, before = doc.get("number"), doc.get("before", 0)
        if not isinstance(number, int) or not 1 <= number <= MAX_NUMBER:
            return None
        self.before = before if isinstance(before, int) and before >= 0 else 0
        return number

    def never_given(self, result_id: int) -> bool:
        """Whether this node's log can hold no result of that id: another
        node's number in its high bits, or in the range skipped to this
        node's base when it first learnt its number."""
        if self.number is None:
            return False
        number = number_of(result_id)
        if number == 0:
            return result_id > self.before
        return number != self.number

    def learn(self, membership: Any, next_id: int) -> bool:
        """Take the number from ``trust.membership`` of the keeper's state
        document (``next_id``: the log's next id now); True when it is new
        (the ids' floor must rise)."""
        if not self.in_fleet or not isinstance(membership, dict):
            return False
        number = membership.get("number")
        if not isinstance(number, int) or not 1 <= number <= MAX_NUMBER:
            return False
        if number == self.number:
            return False
        if self.number is None:
            self.before = next_id - 1
        else:
            # Its row was forgotten and it joined again under another number:
            # ids keep growing, so new ones carry the higher of the two.
            log.warn("fleet_number_changed", old=self.number, new=number)
        self.number = number
        self._save()
        log.log("fleet_number", number=number, first_id=self.first_id())
        return True

    def _save(self) -> None:
        tmp = self.path.with_name(FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"name": self.name, "number": self.number, "before": self.before}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
