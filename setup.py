"""Only the C extensions live here; everything else is in pyproject.toml.

``shm._atomic`` gives the lease table compare-and-swap on shared memory
(shm/leases/; why and the figures: docs/leases.md). ``shm._claim`` is the
claim path in C: the lease table's grant and a whole claim in one call
(workers/claim/path.py; docs/internals.md). Both take their shared-memory offsets
from shm/layout.h and export them (``LEASE_LAYOUT``, ``READY_LAYOUT``), which
shm/layout.py checks against the Python side at import. They build with any C
compiler that has GCC's ``__atomic`` builtins (gcc, clang) and Python headers;
``pip install -e .`` builds them in place. ``node.completion.segments._records``
encodes a group commit's RESULT records (optional: without it the log encodes
them in Python, the same bytes).

``QUEUE_NODE_TEST_STOPS=1`` builds, instead, the test build of ``shm._atomic``
and ``shm._claim``: the same code with the lease table's test stops compiled
in (``-DQUEUE_NODE_TEST_STOPS``; docs/leases.md, "Dying mid-grant"). The tests
build it into a temporary directory of their own (``build_ext --build-lib
DIR``) and their child processes load it from there (``QUEUE_NODE_TEST_BUILD``);
never install it: the production build has no stop in it at all.
"""

import os

from setuptools import Extension, setup

TEST_STOPS = os.environ.get("QUEUE_NODE_TEST_STOPS") == "1"
STOPS = [("QUEUE_NODE_TEST_STOPS", "1")] if TEST_STOPS else []
# the offsets; the counted publish and the stops; the key column writers read
SHARED = ["shm/layout.h", "shm/_publish.h", "shm/_key_column.h"]
# Each module's C files are split by concern for the reader and compiled as one
# translation unit (shm/_atomic_unit.c, shm/_claim_unit.c include them), so a
# call from one file into another on the claim path (the key hash, the grant,
# once a key) is inlined as when they were one file, with any compiler.
ATOMIC_PARTS = [
    "shm/_atomic.c",  # the module, the View, single-word atomics
    "shm/_atomic_scan.c",  # the lease table's scans
    "shm/_atomic_excluded.c",  # the keeper's excluded keys
    "shm/_atomic_seq.c",  # seqlocks, publication, the ready set's entry writer
]
CLAIM_PARTS = [
    "shm/_claim.c",  # the module and its Granter type
    "shm/_grant.c",  # the lease table's grant
    "shm/_complete.c",  # the ledger's completions and peeks, a group in one call
    "shm/_blake2b.c",  # the key hash
    "shm/_owners.c",  # which node owns a key (keeper/owners.py)
    "shm/_claim_path.c",  # ClaimPath: a whole claim in one call
    "shm/_claim_take.c",  # its take from the ready set
    "shm/_claim_grant.c",  # its rows and grants
    "shm/_claim_rows.c",  # its rows handed in (a node on PostgreSQL: the row service)
    "shm/_claim_sqlite.c",  # SQLite, from the library Python's sqlite3 loaded
    "shm/_claim_walk.c",  # Walker: the keeper's load walk of a SQLite schedule
]

atomic = Extension(
    "shm._atomic",
    sources=["shm/_atomic_unit.c"],
    depends=[*SHARED, "shm/_atomic.h", *ATOMIC_PARTS],
    define_macros=STOPS,
    extra_compile_args=["-O2"],
)
claim = Extension(
    "shm._claim",
    sources=["shm/_claim_unit.c"],
    depends=[*SHARED, "shm/_claim.h", "shm/_claim_path.h", *CLAIM_PARTS],
    define_macros=STOPS,
    extra_compile_args=["-O2"],
    libraries=["dl"],  # dlopen/dlsym (in libc itself from glibc 2.34)
)
best = Extension(
    "keeper._best",
    # the merge of class runs; order merges; the keys by slot (KeyColumn)
    sources=["keeper/_best.c", "keeper/_best_order.c", "keeper/_keys.c", "keeper/_keys_lookup.c"],
    depends=["keeper/_keys.h", "shm/_key_column.h"],
    extra_compile_args=["-O2"],
)
# A group commit's RESULT records (node/completion/segments/format.py falls
# back to its Python encoder, the same bytes, when this is not built: optional).
records = Extension(
    "node.completion.segments._records",
    sources=[
        "node/completion/segments/_records.c",
        "node/completion/segments/_records_leases.c",  # compaction's read of a segment
    ],
    extra_compile_args=["-O2"],
    libraries=["z"],  # crc32, the zlib Python's own zlib module uses
    optional=True,
)

setup(ext_modules=[atomic, claim] if TEST_STOPS else [atomic, best, claim, records])
