"""A store URL as it may be shown: with its password taken out.

A PostgreSQL URL may carry a password (``postgresql://user:secret@host/db``).
Whatever prints a URL (logs, ``node.json``, the console, error messages,
process titles) prints ``redact_url(url)``; only the store's driver sees the
URL itself. The password can also come from the environment (``PGPASSWORD``
or a ``~/.pgpass`` file, read by libpq), and then no URL holds it at all.
"""

from __future__ import annotations

import re

# scheme://user:password@ — the password is everything between the first
# ':' after the scheme's '//' and the last '@' before the host.
_PASSWORD_RE = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@?#]*):(?P<pw>[^@/?#]*)@")
# A password given as a query parameter (libpq accepts ?password=...).
_QUERY_PASSWORD_RE = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)
REDACTED = "***"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``; other URLs unchanged."""
    out = _PASSWORD_RE.sub(lambda m: f"{m.group('head')}:{REDACTED}@", url, count=1)
    return _QUERY_PASSWORD_RE.sub(lambda m: m.group(1) + REDACTED, out)


def split_password(url: str) -> tuple[str, str | None]:
    """``url`` without its password, and the password (percent-decoded), or
    ``(url, None)`` when it carries none. The node hands the password to
    libpq through ``PGPASSWORD`` and keeps only the bare URL (in its
    configuration, its children's, its process title)."""
    from urllib.parse import unquote

    m = _PASSWORD_RE.match(url)
    if m is not None:
        return f"{m.group('head')}@{url[m.end() :]}", unquote(m.group("pw"))
    q = re.search(r"([?&])password=([^&#]*)&?", url, re.IGNORECASE)
    if q is not None:
        rest = url[: q.start()] + (q.group(1) if url[q.end() - 1 : q.end()] == "&" else "")
        rest += url[q.end() :]
        return rest.rstrip("?&"), unquote(q.group(2))
    return url, None
