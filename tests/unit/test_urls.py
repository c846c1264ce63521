"""A store URL's password: shown as ``***`` (``redact_url``), and taken out
for libpq's PGPASSWORD (``split_password``)."""

from __future__ import annotations

import pytest

from node.core.urls import redact_url, split_password


@pytest.mark.parametrize(
    ("url", "shown", "bare", "password"),
    [
        ("postgresql://u@h:5432/db", "postgresql://u@h:5432/db", "postgresql://u@h:5432/db", None),
        ("postgresql://u:pw@h/db", "postgresql://u:***@h/db", "postgresql://u@h/db", "pw"),
        ("postgres://u:p%40ss:x@h/db?sslmode=require", "postgres://u:***@h/db?sslmode=require",
         "postgres://u@h/db?sslmode=require", "p@ss:x"),
        ("postgresql://h/db?user=u&password=pw&a=b", "postgresql://h/db?user=u&password=***&a=b",
         "postgresql://h/db?user=u&a=b", "pw"),
        ("postgresql://h/db?password=pw", "postgresql://h/db?password=***",
         "postgresql://h/db", "pw"),
        ("sqlite:////data/a:b@c.db", "sqlite:////data/a:b@c.db", "sqlite:////data/a:b@c.db", None),
    ],
)
def test_a_password_is_redacted_and_split_out(url, shown, bare, password):
    assert redact_url(url) == shown
    assert split_password(url) == (bare, password)
