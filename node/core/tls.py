"""The HTTP server's TLS context, checked before anything starts
(``node.config.tls_context`` names it too)."""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING

from node.core.errors import ConfigError

if TYPE_CHECKING:
    from node.core.config import Config

_TLS_REASONS = {"KEY_VALUES_MISMATCH": "the key does not belong to the certificate"}


def tls_context(config: Config) -> ssl.SSLContext | None:
    """The server's TLS context, or None without ``tls_cert``/``tls_key``.

    The supervisor calls it before anything starts, so a missing, unreadable
    or mismatched certificate is one line and exit 2, not an HTTP worker in a
    restart loop; each worker then builds its own the same way."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    for flag, path in (("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"{flag} {path}: {exc.strerror or exc}") from None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(config.tls_cert), str(config.tls_key))
    except ssl.SSLError as exc:
        reason = _TLS_REASONS.get(exc.reason or "", "")
        raise ConfigError(
            f"--tls-cert {config.tls_cert} with --tls-key {config.tls_key}: "
            f"{reason or 'not a PEM certificate and its private key'} ({exc.reason or exc})"
        ) from None
    return context
