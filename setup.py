"""Only the C extension lives here; everything else is in pyproject.toml.

``shm._atomic`` gives the lease table compare-and-swap on shared memory
(shm/leases.py; why and the figures: docs/leases.md). ``shm._claim`` is the
claim path in C: the lease table's grant and a whole claim in one call
(workers/claim.py; docs/internals.md). It builds with any C
compiler that has GCC's ``__atomic`` builtins (gcc, clang) and Python headers;
``pip install -e .`` builds it in place.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("shm._atomic", sources=["shm/_atomic.c"], extra_compile_args=["-O2"]),
        Extension("keeper._best", sources=["keeper/_best.c"], extra_compile_args=["-O2"]),
        Extension(
            "shm._claim",
            sources=["shm/_claim.c", "shm/_claim_path.c"],
            depends=["shm/_claim.h"],
            extra_compile_args=["-O2"],
            libraries=["dl"],  # dlopen/dlsym (in libc itself from glibc 2.34)
        ),
    ],
)
