"""Shared fixtures. Three tiers live side by side here: unit (memory store,
one tick at a time), integration (real SQLite files, real segments) and
acceptance (``python -m node`` as a subprocess with real signals)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow", action="store_true", default=False, help="also run the large sizes"
    )


def pytest_configure(config: pytest.Config) -> None:
    # Tests start node processes; keep their logs readable in failures.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="large size: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
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
