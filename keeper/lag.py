"""The keeper's commit-to-applied lag figures: p50 / p99 / max of recent changes.

Every applied change adds one sample (``drain_feed``), and every state write
reads the figures; sorting a ring of recent samples for that cost ~3 ms a write
(``bench/bench_state.py``), more than the whole rest of the state document.
So the samples go into log-scale bins, each ``BIN_RATIO`` wider than the last:
an add is one logarithm and one increment, and a percentile is a walk over the
bins, whatever the number of samples. A percentile is reported as the upper
edge of its bin, so it reads at most ``BIN_RATIO - 1`` (5 %) high; the max is
exact.

"Recent" is two windows of ``WINDOW_S``: the figures cover the current window
and the one before (one to two windows of samples), so they follow the load of
the last minutes rather than the node's whole life.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from itertools import accumulate
from math import log
from operator import add
from typing import Any

# Bins from LOWEST_S up, each BIN_RATIO wider: 10 µs to beyond an hour in 430.
LOWEST_S = 1e-5
BIN_RATIO = 1.05
BINS = 430
WINDOW_S = 60.0

_LOG_RATIO = log(BIN_RATIO)
_TOP = BINS - 1


class LagWindow:
    """Lag samples (seconds) of the last one to two windows, binned."""

    __slots__ = ("_current", "_previous", "_window_end", "_max", "_max_previous")

    def __init__(self) -> None:
        self._current = [0] * BINS
        self._previous = [0] * BINS
        self._window_end: float | None = None
        self._max = 0.0
        self._max_previous = 0.0

    def add_many(self, lags: Iterable[float], now: float) -> None:
        """Add the lags of changes applied at ``now`` (wall seconds)."""
        if self._window_end is None or now >= self._window_end:
            self._rotate(now)
        counts = self._current
        top = self._max
        for lag in lags:
            # Bin 0 holds everything up to LOWEST_S (a clock that stepped
            # back gives a negative lag: it counts as no lag).
            i = int(log(lag / LOWEST_S) / _LOG_RATIO) + 1 if lag > LOWEST_S else 0
            counts[i if i < _TOP else _TOP] += 1
            if lag > top:
                top = lag
        self._max = top

    def _rotate(self, now: float) -> None:
        if self._window_end is not None and now < self._window_end + WINDOW_S:
            # The window just ended becomes the previous one.
            self._previous, self._current = self._current, self._previous
            self._max_previous = self._max
        else:  # the first window, or nothing applied for a whole window
            self._previous = [0] * BINS
            self._max_previous = 0.0
        self._current[:] = [0] * BINS
        self._max = 0.0
        self._window_end = now + WINDOW_S

    def __len__(self) -> int:
        return sum(self._current) + sum(self._previous)

    def figures(self) -> dict[str, Any] | None:
        """``{samples, p50_ms, p99_ms, max_ms}``, or None without samples."""
        # Samples up to and including each bin: a percentile is a bisection.
        seen = list(accumulate(map(add, self._current, self._previous)))
        n = seen[-1]
        if not n:
            return None
        top = max(self._max, self._max_previous)
        return {
            "samples": n,
            "p50_ms": round(min(_upper_edge(seen, n // 2), top) * 1000, 3),
            "p99_ms": round(min(_upper_edge(seen, (n * 99) // 100), top) * 1000, 3),
            "max_ms": round(top * 1000, 3),
        }


def _upper_edge(seen: list[int], rank: int) -> float:
    """The upper edge of the bin holding the sample of 0-based ``rank``
    (``seen``: the samples up to and including each bin)."""
    return LOWEST_S * BIN_RATIO ** min(bisect_right(seen, rank), _TOP)
