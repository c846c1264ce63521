"""Inference handlers: loading ``MODULE:CALLABLE`` and the built-in CPU handler.

A handler is named only by the node's own configuration (``--handler``,
``handler =`` in the file, or a route's ``handler``), never by anything a
request carries: loading one imports and runs code.

Two shapes are accepted (CONTRACT.md, "Inference handler for --handler"):

- a callable taking a list of items and returning one result per item;
- a class with ``setup(device)`` and ``__call__(items)``: it is instantiated
  once per inference process (no arguments) and ``setup`` is called once,
  with ``"cuda:0"`` when the process has a GPU and ``"cpu"`` otherwise.
  An object (not a class) with ``setup`` is set up the same way.

An item is a dict: ``key``, ``payload``, ``job``, ``lease_id`` and ``route``.
A result is bytes, a JSON value, or an exception instance for an item that
failed (that item alone is released with the error). An exception raised by
the call fails the whole batch.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from node.core.config import parse_handler_spec
from node.core.errors import ConfigError

Items = Sequence[dict[str, Any]]


class HandlerError(ConfigError):
    """A handler named in the configuration cannot be loaded or set up."""


def parse_spec(spec: str) -> tuple[str, str]:
    """``MODULE:CALLABLE`` → (module, attribute path); HandlerError when the
    text has another form (the configuration checked it already: this is
    for a spec that did not come through it)."""
    try:
        return parse_handler_spec(spec)
    except ConfigError as exc:
        raise HandlerError(str(exc)) from None


def check_spec(spec: str) -> None:
    """Check, without importing the handler's module, that it can be found.

    For the supervisor, before any process starts: a misspelt module is one
    clear error then, not an inference process in a restart loop. (Finding
    ``a.b`` imports the package ``a``, not ``a.b``.)"""
    module, _attr = parse_spec(spec)
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise HandlerError(f"handler {spec!r}: cannot find module {module!r}: {exc}") from None
    if found is None:
        raise HandlerError(
            f"handler {spec!r}: no module named {module!r} (is it installed, or on PYTHONPATH?)"
        )


def load(spec: str) -> Any:
    """Import the module and return the named attribute (a function, a class
    or an object). HandlerError names the module or the attribute that is
    missing, with the cause."""
    module_name, attr_path = parse_spec(spec)
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise HandlerError(
            f"handler {spec!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - the user's module failed at import
        raise HandlerError(
            f"handler {spec!r}: importing module {module_name!r} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise HandlerError(
                f"handler {spec!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(target):
        raise HandlerError(
            f"handler {spec!r}: {attr_path!r} is a {type(target).__name__}, not a callable "
            "or a class with setup(device) and __call__(items)"
        )
    return target


class HandlerResultError(Exception):
    """A handler's answer does not have one result per item: the batch fails."""


class Handler:
    """A loaded handler, ready to be set up once and called per batch."""

    def __init__(self, spec: str, target: Any) -> None:
        self.spec = spec
        self._target = target
        self._call: Callable[[Items], Any] | None = None
        self.device: str | None = None

    @classmethod
    def load(cls, spec: str) -> Handler:
        return cls(spec, load(spec))

    def setup(self, device: str) -> None:
        """Instantiate a class handler and call its ``setup(device)``, once."""
        if self._call is not None:
            return
        target = self._target
        if isinstance(target, type):
            try:
                target = target()
            except Exception as exc:  # noqa: BLE001 - the user's constructor
                raise HandlerError(
                    f"handler {self.spec!r}: {type(exc).__name__} in the class constructor: {exc}"
                ) from exc
            if not callable(target):
                raise HandlerError(f"handler {self.spec!r}: the class has no __call__(items)")
        setup = getattr(target, "setup", None)
        # A function may carry a ``setup`` attribute by accident (a decorator):
        # only objects of the class shape are set up.
        if callable(setup) and not inspect.isroutine(target):
            try:
                setup(device)
            except Exception as exc:  # noqa: BLE001 - the user's setup
                raise HandlerError(
                    f"handler {self.spec!r}: setup({device!r}) failed: {type(exc).__name__}: {exc}"
                ) from exc
        self.device = device
        self._call = target

    def __call__(self, items: Items) -> list[Any]:
        """Run one batch. Raises whatever the handler raises (the caller fails
        the batch) and HandlerResultError when the answer has the wrong shape."""
        if self._call is None:
            raise RuntimeError(f"handler {self.spec!r} used before setup()")
        results = self._call(items)
        if isinstance(results, str | bytes | bytearray | dict) or results is None:
            raise HandlerResultError(
                f"handler returned a {type(results).__name__}, not one result per item"
            )
        try:
            results = list(results)
        except TypeError:
            raise HandlerResultError(
                f"handler returned a {type(results).__name__}, not one result per item"
            ) from None
        if len(results) != len(items):
            raise HandlerResultError(
                f"handler returned {len(results)} results for {len(items)} items"
            )
        return results

    def __repr__(self) -> str:
        return f"Handler({self.spec!r}, device={self.device!r})"


# -- the built-in CPU handler ------------------------------------------------------

# Rounds of SHA-256 per item: about 1 ms on a current x86 core. Tunable for the
# demo and for load tests without a GPU; it is a handler setting, not a node
# option (the node never reads it).
CPU_WORK_ROUNDS_ENV = "QUEUE_NODE_CPU_WORK_ROUNDS"
CPU_WORK_DEFAULT_ROUNDS = 2500
CPU_WORK_MAX_ROUNDS = 10_000_000


def cpu_work_rounds(env: dict[str, str] | None = None) -> int:
    text = (os.environ if env is None else env).get(CPU_WORK_ROUNDS_ENV, "")
    if not text:
        return CPU_WORK_DEFAULT_ROUNDS
    try:
        rounds = int(text)
    except ValueError:
        rounds = -1
    if not 0 <= rounds <= CPU_WORK_MAX_ROUNDS:
        raise HandlerError(
            f"{CPU_WORK_ROUNDS_ENV} = {text!r} is not valid: an integer from 0 to "
            f"{CPU_WORK_MAX_ROUNDS}"
        )
    return rounds


class CpuWork:
    """``node.handlers:cpu_work``: a deterministic stand-in for a model.

    Hashes each item's key and payload ``rounds`` times (SHA-256) and answers
    ``{"digest": <hex prefix>, "rounds": n}``: the same item always gives the
    same result, on any host, so a demo or a test can check every result."""

    def __init__(self) -> None:
        self.rounds = CPU_WORK_DEFAULT_ROUNDS
        self.device = "cpu"

    def setup(self, device: str) -> None:
        # A CPU handler: the device is recorded, not used.
        self.device = device
        self.rounds = cpu_work_rounds()

    def __call__(self, items: Items) -> list[Any]:
        return [
            {
                "digest": cpu_digest(item["key"], item.get("payload"), self.rounds),
                "rounds": self.rounds,
            }
            for item in items
        ]


def cpu_digest(key: str, payload: Any, rounds: int) -> str:
    """The digest ``CpuWork`` answers for one item (for checking results)."""
    seed = json.dumps([key, payload], sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(seed).digest()
    for _ in range(rounds):
        digest = hashlib.sha256(digest).digest()
    return digest.hex()[:16]


cpu_work = CpuWork
