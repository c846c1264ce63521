"""The node's exceptions, where programs that catch them import them from:
``node.errors.NodeNotRunning`` and the rest. They are defined in
``node/core/errors.py``; this module names the same classes."""

from node.core.errors import (
    ClientError,
    ConfigError,
    LayoutMismatch,
    LeaseConflict,
    NameTaken,
    NodeError,
    NodeNotRunning,
    NodeRestarted,
    NotGranting,
    NotReady,
    StoreError,
    StoreUnavailable,
    TooManyClasses,
    UnsupportedStore,
    ValidationError,
    WorkRefused,
    WorkUnavailable,
)

__all__ = [
    "ClientError",
    "ConfigError",
    "LayoutMismatch",
    "LeaseConflict",
    "NameTaken",
    "NodeError",
    "NodeNotRunning",
    "NodeRestarted",
    "NotGranting",
    "NotReady",
    "StoreError",
    "StoreUnavailable",
    "TooManyClasses",
    "UnsupportedStore",
    "ValidationError",
    "WorkRefused",
    "WorkUnavailable",
]
