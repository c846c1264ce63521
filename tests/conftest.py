"""Shared fixtures of the four tiers, each a folder:

- ``unit/``: plain objects in one process (the key table, delivery queues,
  the layout's promises);
- ``integration/``: real SQLite files, real segments, real child processes
  killed for real, but no whole node;
- ``acceptance/``: ``python -m node`` as a subprocess (``node.testing``),
  driven over HTTP, the command line and signals;
- ``campaign/``: fault campaigns, fuzzing and the fault table against a real
  node (the campaign's own harness lives beside them).

``pytest tests/unit`` runs one tier; the default run runs them all."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow", action="store_true", default=False, help="also run the large sizes"
    )
    parser.addoption(
        "--run-model",
        action="store_true",
        default=False,
        help="also run the real model (needs the model extra: scripts/setup test,model)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Tests start node processes; keep their logs readable in failures.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Each flag lets its marker's tests run; without it they are skipped.
    flags = {
        "slow": ("--run-slow", "large size: run with --run-slow"),
        "model": ("--run-model", "the real model: run with --run-model (the model extra)"),
    }
    for marker, (option, reason) in flags.items():
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def stops_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The extensions with the lease table's test stops compiled in, built
    once a session: the directory to give children as QUEUE_NODE_TEST_BUILD."""
    from tests.procs import build_with_stops

    return build_with_stops(tmp_path_factory.getbasetemp())


@pytest.fixture
def node_name() -> str:
    """A node name no other test (or running node) uses."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """This run's own PostgreSQL database (tests/pg.py): created on first
    use, dropped at the end. No server fails the test, it does not skip."""
    from tests.pg import create_database, drop_database

    url = create_database()
    yield url
    drop_database(url)


@pytest.fixture
def net() -> Iterator[object]:
    """A bridge for nodes in network namespaces of their own, the test
    database behind it (tests/netns.py), closed after the test. Without
    root or the tools it skips, and fails under ``CI=true``."""
    from tests import pg
    from tests.netns import Net, NetUnavailable

    try:
        made = Net(pg.SERVER).__enter__()
    except NetUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"network namespaces cannot be made: {exc}")
        pytest.skip(f"network namespaces cannot be made: {exc}")
    try:
        yield made
    finally:
        made.close()
