"""``ReadySet``: one handle on the ready set, both sides of it. The keeper
publishes through it (``ReadyWriter``), claimers take from it and the console
snapshots it (``ReadyReader``); mapping and the switch are shared
(``ReadySetBase``). The protocol and layout: shm/ready/layout.py."""

from __future__ import annotations

from shm.ready.publish import ReadyWriter
from shm.ready.take import ReadyReader


class ReadySet(ReadyWriter, ReadyReader):
    """The ready set: ``create`` (the supervisor), ``attach`` (everyone else),
    ``publish`` (the keeper), ``take`` (claimers), ``snapshot``."""
