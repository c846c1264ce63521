"""The test run's own PostgreSQL database: created once a session, emptied
before each test that uses it, dropped at the end.

The server is ``QUEUE_NODE_TEST_PG`` (default ``postgresql://postgres@
127.0.0.1:5432``, trust authentication, as on CI). A server that is not
there fails the tests that need it: they are part of the suite, not extras.
"""

from __future__ import annotations

import os
import secrets

import psycopg

SERVER = os.environ.get("QUEUE_NODE_TEST_PG", "postgresql://postgres@127.0.0.1:5432")

# What a test starts from: no rows, no changes, no meta, seqs from 1 again.
# (DELETE, not TRUNCATE: on a few rows it is several times faster.)
_RESET = (
    "DELETE FROM schedule",
    "DELETE FROM changes",
    "DELETE FROM node_meta",
    "DELETE FROM fleet_nodes",
    "UPDATE changes_trimmed SET through = 0",
    "SELECT setval('changes_seq', 1, false)",
)


def create_database(*, flush_commits: bool = False) -> str:
    """A new empty database on SERVER; returns its URL. Its commits do not
    wait for their WAL flush (the tests' writes are lost only to a crash of
    the server, which ends the run anyway) unless ``flush_commits`` (the
    bench measures what a node would)."""
    name = f"queue_node_test_{os.getpid()}_{secrets.token_hex(4)}"
    with psycopg.connect(f"{SERVER}/postgres", autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
        if not flush_commits:
            conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    return f"{SERVER}/{name}"


def drop_database(url: str) -> None:
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(f"{SERVER}/postgres", autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def reset(url: str) -> None:
    """Empty the node's tables (the schema stays: migrations ran once)."""
    with psycopg.connect(url, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('schedule') IS NOT NULL").fetchone()
        if exists is None or not exists[0]:
            return
        with conn.transaction():
            for statement in _RESET:
                conn.execute(statement)
