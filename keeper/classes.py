"""The class table: small integer ids for route × cadence × source × sitemap.

Rows of one class share their cadence and boost, so inside a class the row
due earliest always ranks highest and the keeper never rescores a row (see
``keeper/buckets/``). A row whose ``cadence_s`` is None takes its route's
default; that default comes from the configuration, so such a class is
"route-sourced" and follows the configuration when it changes (SIGHUP),
while a row-sourced class keeps the cadence its rows carry.

With the node's shared class table (shm/classes.py), a class is created
only when the table holds it or has room for it: the workers reserve a
write's classes there before the write, so the keeper's table and theirs
agree and a row written through the node always has its class.

Ids are never reused while the keeper lives: an id seen in a published entry
can never come to mean another class. An id is retired only when the buckets
find its class empty and need room under ``max_classes``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from node.core.classes import SOURCE_ROUTE, ClassId, class_id
from node.core.config import Config
from node.core.errors import TooManyClasses


class ClassInfo(NamedTuple):
    route: str
    cadence_s: int
    source: str  # SOURCE_ROW or SOURCE_ROUTE
    sitemap: bool
    boost: float  # the route's sitemap_boost for sitemap classes, else 0


# (route, cadence_s, source, sitemap): what makes two rows the same class.
Identity = ClassId


def _identity(info: ClassInfo) -> Identity:
    return (info.route, info.cadence_s, info.source, info.sitemap)


class ClassTable:
    """Class ids for the keeper; ``class_of`` is on the hot path (one dict
    lookup when the class exists)."""

    def __init__(self, config: Config, shared: Any = None) -> None:
        self._config = config
        # The node's shm.classes.SharedClasses, or None (a keeper alone).
        self.shared = shared
        if shared is not None:
            shared.set_limit(config.max_classes)
        self._info: dict[int, ClassInfo] = {}
        self._by_identity: dict[Identity, int] = {}
        # (route, cadence_s as the row carries it (None: route default), sitemap)
        # -> id. Derived from _info; rebuilt when the configuration changes.
        self._lookup: dict[tuple[str, int | None, bool], int] = {}
        self._next_id = 0

    @property
    def config(self) -> Config:
        return self._config

    def class_of(self, route: str, cadence_s: int | None, sitemap: bool) -> int:
        """The id of a row's class, created on first use.

        Raises TooManyClasses when creating it would pass ``max_classes``.
        """
        cid = self._lookup.get((route, cadence_s, sitemap))
        if cid is None:
            cid = self._create(route, cadence_s, bool(sitemap))
        return cid

    def known(self, triples: Iterable[tuple[str, int | None, bool]]) -> list[int | None]:
        """``class_of`` for many rows at once, without creating: the id of
        each ``(route, cadence_s, sitemap)`` whose class exists, else None.
        One dict lookup a row (the bulk load resolves a chunk with it)."""
        return list(map(self._lookup.get, triples))

    def _create(self, route: str, cadence_s: int | None, sitemap: bool) -> int:
        info = self._describe(self._config, route, cadence_s, sitemap)
        cid = self._by_identity.get(_identity(info))
        if cid is None:
            if len(self._info) >= self._config.max_classes:
                raise TooManyClasses(
                    f"route {route!r} with cadence {info.cadence_s} s would make class "
                    f"{len(self._info) + 1}; at most {self._config.max_classes} allowed "
                    "(max_classes)",
                    "cadence_s" if cadence_s is not None else "route",
                )
            if self.shared is not None:
                try:
                    self.shared.reserve([(route, cadence_s, sitemap)])
                except ValueError:  # no slot can name it (a route over 128 bytes)
                    raise TooManyClasses(f"route {route!r} cannot have a class", "route") from None
            cid = self._next_id
            self._next_id += 1
            self._info[cid] = info
            self._by_identity[_identity(info)] = cid
        self._lookup[(route, cadence_s, sitemap)] = cid
        return cid

    @staticmethod
    def _describe(config: Config, route: str, cadence_s: int | None, sitemap: bool) -> ClassInfo:
        settings = config.route(route)
        boost = float(settings.sitemap_boost) if sitemap else 0.0
        return ClassInfo(*class_id(route, cadence_s, sitemap, settings.cadence_s), boost)

    def info(self, cid: int) -> ClassInfo:
        """Raises KeyError for an id never given out, or retired."""
        return self._info[cid]

    def ids(self) -> list[int]:
        return list(self._info)

    def __len__(self) -> int:
        return len(self._info)

    def __contains__(self, cid: object) -> bool:
        return cid in self._info

    def retire(self, cid: int) -> None:
        """Forget a class that holds no rows (the caller knows it is empty)."""
        info = self._info.pop(cid)
        del self._by_identity[_identity(info)]
        self._lookup = {k: v for k, v in self._lookup.items() if v != cid}

    def reconfigure(self, config: Config) -> list[tuple[int, int]]:
        """Take a new configuration (SIGHUP). Returns ``(old_id, new_id)`` for
        every class whose identity now equals another class's: the caller
        moves the old class's rows into the new one; the old id is retired.

        A boost change only updates the class's info. A route-sourced class
        whose route default changed takes the new cadence in place (same id)
        unless a class with that identity already exists. Classes that keep
        their identity win over classes that move onto it, so a merge never
        renames the class that stood still.
        """
        described = {
            cid: self._describe(
                config,
                info.route,
                None if info.source == SOURCE_ROUTE else info.cadence_s,
                info.sitemap,
            )
            for cid, info in self._info.items()
        }
        moved = [
            cid for cid, info in described.items() if _identity(info) != _identity(self._info[cid])
        ]
        still = set(described) - set(moved)
        by_identity = {_identity(described[cid]): cid for cid in still}
        merges: list[tuple[int, int]] = []
        for cid in moved:
            ident = _identity(described[cid])
            winner = by_identity.get(ident)
            if winner is None:
                by_identity[ident] = cid
            else:
                merges.append((cid, winner))
                del described[cid]
        self._config = config
        if self.shared is not None:
            self.shared.set_limit(config.max_classes)
        self._info = described
        self._by_identity = by_identity
        self._lookup = {}
        for cid, info in described.items():
            carried = None if info.source == SOURCE_ROUTE else info.cadence_s
            self._lookup[(info.route, carried, info.sitemap)] = cid
        return merges
