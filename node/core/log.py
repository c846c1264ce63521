"""Structured, one-line logs: ``action=… key=value`` on stderr.

Every process logs through ``log(action, **fields)`` so a line can be grepped
by action and parsed by a machine; a process ends with one summary line.
"""

from __future__ import annotations

import json
import logging
import os
import sys

_logger = logging.getLogger("queue-node")
_configured = False


def setup(role: str, verbose: bool = False) -> None:
    global _configured
    if _configured:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {role}[{os.getpid()}] %(message)s")
    )
    _logger.addHandler(handler)
    _logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    _logger.propagate = False
    _configured = True


def _fmt(value: object) -> str:
    if isinstance(value, str) and value and " " not in value and "=" not in value:
        return value
    return json.dumps(value, default=str)


def log(action: str, level: int = logging.INFO, **fields: object) -> None:
    parts = [f"action={action}"]
    parts += [f"{k}={_fmt(v)}" for k, v in fields.items()]
    _logger.log(level, " ".join(parts))


def warn(action: str, **fields: object) -> None:
    log(action, logging.WARNING, **fields)


def error(action: str, exc_info: bool = False, **fields: object) -> None:
    parts = " ".join([f"action={action}"] + [f"{k}={_fmt(v)}" for k, v in fields.items()])
    _logger.error(parts, exc_info=exc_info)
