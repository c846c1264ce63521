"""A row's class: route × effective cadence × cadence source × sitemap flag.

Rows of one class share their cadence and boost, so inside a class the row
due earliest always ranks highest (docs/design.md). A row whose
``cadence_s`` is None takes its route's default: its class is
"route-sourced" and follows the configuration when it changes; a row that
carries its own cadence is "row-sourced". This is the one definition: the
keeper's class table (``keeper/classes.py``) gives these identities ids, and
the workers and the importer use them to refuse a write that would create
too many classes (``workers/classes.py``).
"""

from __future__ import annotations

SOURCE_ROW = "row"
SOURCE_ROUTE = "route"

# (route, effective cadence_s, source SOURCE_ROW | SOURCE_ROUTE, sitemap)
ClassId = tuple[str, int, str, bool]


def class_id(route: str, cadence_s: int | None, sitemap: bool, route_cadence_s: int) -> ClassId:
    """The class of a row with this route, own cadence (None: the route's,
    ``route_cadence_s``) and sitemap flag."""
    if cadence_s is None:
        return (route, int(route_cadence_s), SOURCE_ROUTE, bool(sitemap))
    return (route, int(cadence_s), SOURCE_ROW, bool(sitemap))


# (route, cadence_s as the row carries it (None: the route's default),
# sitemap): one-to-one with ClassId under any one configuration, and the same
# under every one (shm/classes.py names classes so).
Carried = tuple[str, int | None, bool]


def carried(cid: ClassId) -> Carried:
    """The fields a row of class ``cid`` carries that make its class."""
    route, cadence_s, source, sitemap = cid
    return (route, None if source == SOURCE_ROUTE else cadence_s, bool(sitemap))
