"""Only the C extension lives here; everything else is in pyproject.toml.

``shm._atomic`` gives the lease table compare-and-swap on shared memory
(shm/leases.py; why and the figures: docs/leases.md). ``shm._claim`` is the
claim path in C: the lease table's grant and a whole claim in one call
(workers/claim/path.py; docs/internals.md). It builds with any C
compiler that has GCC's ``__atomic`` builtins (gcc, clang) and Python headers;
``pip install -e .`` builds it in place.

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

atomic = Extension(
    "shm._atomic",
    sources=["shm/_atomic.c"],
    depends=["shm/_claim.h"],  # the counted publish and the stops are shared
    define_macros=STOPS,
    extra_compile_args=["-O2"],
)
claim = Extension(
    "shm._claim",
    sources=["shm/_claim.c", "shm/_claim_path.c"],
    depends=["shm/_claim.h"],
    define_macros=STOPS,
    extra_compile_args=["-O2"],
    libraries=["dl"],  # dlopen/dlsym (in libc itself from glibc 2.34)
)
best = Extension("keeper._best", sources=["keeper/_best.c"], extra_compile_args=["-O2"])

setup(ext_modules=[atomic, claim] if TEST_STOPS else [atomic, best, claim])
