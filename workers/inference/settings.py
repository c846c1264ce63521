"""What one inference process runs with: its ``Settings`` (from the
configuration and its command line) and its ``Handlers``, one a spec, each
loaded once (the process itself: workers/inference/process.py)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

from node.core.config import Config
from node.handlers import Handler, HandlerError

# Defaults of the options config.py may not carry yet (``batch_size``,
# ``handler_timeout_s``); the configuration wins when it has them.
DEFAULT_BATCH_SIZE = 16
# A wedged device is told from a slow batch by a timeout far beyond a lease:
# ten lease lengths, and never under a minute (a first batch may warm caches).
HANDLER_TIMEOUT_LEASES = 10
HANDLER_TIMEOUT_FLOOR_S = 60.0
# Renew at a third of the lease: a renewal can be missed twice (a busy slot,
# a thread starved for a moment) before the lease runs out.
RENEW_FRACTION = 1 / 3


@dataclass(frozen=True)
class Settings:
    index: int
    gpu: int | None
    consumer: str
    batch_size: int
    lease_s: float
    handler_timeout_s: float
    drain_timeout_s: float

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else "cuda:0"

    @property
    def renew_every_s(self) -> float:
        return self.lease_s * RENEW_FRACTION

    @classmethod
    def from_config(cls, config: Config, index: int, gpu: int | None) -> Settings:
        lease_s = float(config.lease_s)
        timeout_s = getattr(config, "handler_timeout_s", None) or default_handler_timeout_s(lease_s)
        return cls(
            index=index,
            gpu=gpu,
            consumer=f"inference-{index}@{socket.gethostname()}",
            batch_size=int(getattr(config, "batch_size", None) or DEFAULT_BATCH_SIZE),
            lease_s=lease_s,
            handler_timeout_s=float(timeout_s),
            drain_timeout_s=float(config.drain_timeout_s),
        )


def default_handler_timeout_s(lease_s: float) -> float:
    return max(HANDLER_TIMEOUT_FLOOR_S, HANDLER_TIMEOUT_LEASES * lease_s)


# -- handlers by route ---------------------------------------------------------------------


class Handlers:
    """The node's default handler and every route's own, each loaded once.

    Specs come from the configuration only; a request never names one."""

    def __init__(self, config: Config, load: Callable[[str], Handler] = Handler.load) -> None:
        if not config.handler:
            raise HandlerError("no handler configured: set --handler MODULE:CALLABLE")
        self.config = config
        self.default_spec = config.handler
        specs = {config.handler}
        if config.defaults.handler:
            specs.add(config.defaults.handler)
        specs.update(r.handler for r in config.routes.values() if r.handler)
        self.by_spec = {spec: load(spec) for spec in sorted(specs)}

    @property
    def by_route(self) -> bool:
        """Whether the route decides the handler (else every item takes the default)."""
        return len(self.by_spec) > 1

    def spec_for(self, route: str | None) -> str:
        if route is None:
            return self.default_spec
        return self.config.route(route).handler or self.default_spec

    def setup(self, device: str) -> None:
        for handler in self.by_spec.values():
            handler.setup(device)
