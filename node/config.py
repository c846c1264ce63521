"""Where programs import the configuration from (``node.config.Config``,
``load_config`` and the rest). It is defined in ``node/core/config.py``;
this module names the same objects."""

from node.core.config import (
    ENV_PREFIX,
    HANDLER_SPEC_RE,
    MAX_RETENTION_S,
    NAME_RE,
    OPTIONS,
    UNIX_PREFIX,
    Config,
    JobConfig,
    RouteConfig,
    check_name,
    check_store_url,
    load_config,
    load_run_config,
    parse_duration,
    parse_handler_spec,
    tls_context,
    validate,
)

__all__ = [
    "ENV_PREFIX",
    "HANDLER_SPEC_RE",
    "MAX_RETENTION_S",
    "NAME_RE",
    "OPTIONS",
    "UNIX_PREFIX",
    "Config",
    "JobConfig",
    "RouteConfig",
    "check_name",
    "check_store_url",
    "load_config",
    "load_run_config",
    "parse_duration",
    "parse_handler_spec",
    "tls_context",
    "validate",
]
