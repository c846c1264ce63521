"""Which live node owns a key: rendezvous hashing over the node list.

In a fleet every row of the shared schedule is owned by exactly one live node,
and a keeper holds only the rows its node owns (docs/design.md, "One host, then
a fleet"). Rendezvous (highest random weight) hashing is chosen because a
membership change moves only the rows it must: a node joining takes about 1/N
of the keys, an even share from every other node; a node leaving hands its
keys out evenly; no other key changes owner. The rows a change moves are
exactly those the keepers reclassify (the losing keeper drops them, counted as
withdrawn; the gaining keeper's walk adds them, counted as received).

The definition, which every node of a fleet must compute alike whatever its
build (``tests/unit/test_owners.py`` pins it with fixed answers):

- ``h = blake2b64(key's UTF-8)``, the lease table's key hash (shm/leases);
- a node's seed ``s = blake2b64(name's UTF-8)``;
- the key's weight on that node ``mix64(h ^ s)``, SplitMix64's finaliser (the
  XOR alone would rank the nodes the same way for keys that share high bits);
- the owner is the node of highest weight; a tie (odds 2^-64) goes to the
  name first in sorted order.

A chunk of keys is classified in C (``shm._claim.owners_of``: about 0.1 µs a
key against 3 µs in Python for three nodes); without the extension the
Python below gives the same answers.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

try:
    from shm import _claim  # type: ignore[attr-defined]  # C, built by setup.py
except ImportError:  # a build without the C extensions
    _claim = None  # type: ignore[assignment]

# An owner's index is one byte in the C answer; a fleet of more than 255 nodes
# on one schedule is far past what this design is built for (docs/design.md).
MAX_NODES = 255

_MASK64 = (1 << 64) - 1


def key_hash(raw: bytes) -> int:
    """blake2b64: hashlib's 8-byte BLAKE2b digest as a little-endian integer."""
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def mix64(z: int) -> int:
    """SplitMix64's finaliser: every bit of the input moves about half the
    bits of the output."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Ownership:
    """The owner of every key among one node list (sorted and without
    duplicates, whatever order it came in); ``me`` is this node, when it is in
    the list."""

    __slots__ = ("nodes", "me", "_seeds", "_packed", "_me_at")

    def __init__(self, nodes: Iterable[str], me: str | None = None) -> None:
        names = list(nodes)
        if not names:
            raise ValueError("a node list needs at least one node")
        if len(set(names)) != len(names):
            raise ValueError("a node list names each node once")
        if len(names) > MAX_NODES:
            raise ValueError(f"a node list holds at most {MAX_NODES} nodes, not {len(names)}")
        self.nodes: tuple[str, ...] = tuple(sorted(names))
        if me is not None and me not in self.nodes:
            raise ValueError(f"node {me!r} is not in the node list")
        self.me = me
        self._me_at = -1 if me is None else self.nodes.index(me)
        self._seeds = [key_hash(name.encode()) for name in self.nodes]
        self._packed = struct.pack(f"={len(self._seeds)}Q", *self._seeds)

    def owner(self, key: str) -> str:
        """The node that owns ``key``."""
        return self.nodes[self.owner_indexes([key])[0]]

    def owns(self, key: str) -> bool:
        """Whether this node (``me``) owns ``key``."""
        return self.owner_indexes([key])[0] == self._me_at

    def owner_indexes(self, keys: Sequence[str]) -> bytes:
        """Each key's owner as an index into ``nodes``, one byte a key."""
        if _claim is not None:
            return _claim.owners_of(keys if isinstance(keys, list) else list(keys), self._packed)
        return bytes(self._owner_index_py(key) for key in keys)

    def mine(self, keys: Sequence[str]) -> list[str]:
        """The keys of ``keys`` this node owns, in their order."""
        if self._me_at < 0:
            return []
        at = self._me_at
        return [key for key, i in zip(keys, self.owner_indexes(keys), strict=True) if i == at]

    def _owner_index_py(self, key: str) -> int:
        h = key_hash(key.encode())
        best_at, best = 0, -1
        for at, seed in enumerate(self._seeds):
            weight = mix64(h ^ seed)
            if weight > best:
                best_at, best = at, weight
        return best_at

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ownership) and (self.nodes, self.me) == (other.nodes, other.me)

    def __hash__(self) -> int:
        return hash((self.nodes, self.me))

    def __repr__(self) -> str:
        return f"Ownership({list(self.nodes)!r}, me={self.me!r})"
