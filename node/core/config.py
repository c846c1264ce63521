"""Configuration: one dataclass, filled from the TOML file, then the
environment (``QUEUE_NODE_<OPTION>``), then the command line, each winning over
the one before. Everything is validated here, before any process starts, and
every error names the option, where it came from and what is allowed.

Part of the core: it imports nothing else of the project, so the checks that
need more (that a handler's module can be found, that the store opens) are
the application's, after these (``node.handlers.check_spec``,
``node.store.open_store``). ``node.config`` names the same objects.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.core.errors import ConfigError, NodeError, UnsupportedStore
from node.core.fleet import check_fleet, parse_peers
from node.core.names import NAME_RE, check_name, host_node_name
from node.core.proc import ENV_CONFIG
from node.core.rows import JOB_RE, MAX_CADENCE_S, MIN_CADENCE_S
from node.core.tls import tls_context
from node.core.urls import redact_url

__all__ = [
    "ENV_PREFIX", "HANDLER_SPEC_RE", "MAX_RETENTION_S", "NAME_RE", "OPTIONS", "UNIX_PREFIX",
    "Config", "JobConfig", "RouteConfig", "check_name", "check_store_url",
    "load_config", "load_run_config", "parse_duration", "parse_handler_spec",
    "tls_context", "validate",
]  # fmt: skip

# ``--http unix:PATH``: serve on a UNIX socket file instead of TCP. Its path
# must fit sockaddr_un's sun_path (108 bytes with the terminating NUL).
UNIX_PREFIX = "unix:"
MAX_UNIX_PATH_BYTES = 107
ENV_PREFIX = "QUEUE_NODE_"
# Segments of the completion log live in <data-dir>/LOG_DIR (the ledger's; the
# supervisor looks there too, without importing the ledger).
LOG_DIR = "log"
# A bearer token travels in an HTTP header: visible ASCII only (RFC 6750's
# b64token is narrower still), so every client can send it byte for byte.
TOKEN_RE = re.compile(r"[\x21-\x7e]{1,4096}")

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str | int | float, what: str = "duration") -> float:
    """``90s``, ``15m``, ``1h``, ``1d``, ``7d`` or plain seconds."""
    if isinstance(text, bool):
        raise ConfigError(f"{what} must be a duration like 90s, 15m, 1h, 1d or seconds")
    if isinstance(text, int | float):
        return float(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", str(text))
    if not m:
        raise ConfigError(f"{what} {text!r} is not a duration: use 90s, 15m, 1h, 1d, 7d or seconds")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


@dataclass(frozen=True, slots=True)
class RouteConfig:
    cadence_s: int = 86400
    sitemap_boost: float = 0.5
    handler: str | None = None


# A job's retention: at most ten years (and more than nothing).
MAX_RETENTION_S = 10 * 365 * 86400


@dataclass(frozen=True, slots=True)
class JobConfig:
    """``[jobs.NAME]``: per-job settings of the ledger. ``retention_s``: a
    result not acknowledged this long after it finished is discarded (counted
    in ``discarded``, docs/delivery.md); None keeps it until it is acked."""

    retention_s: float | None = None


def _default_workers() -> int:
    return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Config:
    data_dir: Path = Path("node-data")
    store: str = ""  # empty: sqlite:///<data_dir>/schedule.db
    name: str = ""  # empty: the host name, cleaned to the allowed characters
    http: str = "127.0.0.1:8470"
    workers: int = field(default_factory=_default_workers)
    handler: str | None = None
    inference_procs: int = 0
    gpus: tuple[int, ...] = ()
    lease_s: float = 60.0
    ready_size: int = 5000
    token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    offer_timeout_s: float = 30.0
    # A repeat of an accepted completion is answered `repeat` with its result
    # id until the result is retired and for this long after: the contract's
    # "at least an hour" (docs/delivery.md, "Repeats").
    repeat_window_s: float = 3600.0
    # Group commit: the ledger waits this long after a completion arrives
    # before it flushes. 0 flushes what is queued at once (completions that
    # arrive meanwhile make the next group); a window only lowered throughput
    # in measurements (docs/delivery.md).
    ledger_group_window_s: float = 0.0
    max_misses: int = 10
    max_classes: int = 4096
    verify_interval_s: float = 3600.0
    drain_timeout_s: float = 30.0
    publish_interval_s: float = 1.0
    state_interval_s: float = 5.0
    state_group: str | None = None
    # Lease-table slots: bounds live + held + parked keys, not rows.
    lease_capacity: int = 65_536
    # Leases an inference process claims per batch (only when it is idle).
    batch_size: int = 16
    # A handler call running longer is stopped and its leases released; None:
    # max(60, 10 × lease_s) — ten leases tells a wedged GPU from a slow batch.
    handler_timeout_s: float | None = None
    # The completion log: when results are made durable ("batch": one fsync
    # per group commit; "always": one per record; "never": leave it to the
    # OS, and lose the last seconds of results to a power cut) and the size
    # at which a segment file rolls over (compaction removes whole segments).
    log_fsync: str = "batch"
    log_segment_bytes: int = 64 << 20
    # How far ahead of its writes the active segment is filled with zeros,
    # so that a group's fsync changes no file metadata (0: off; worth turning
    # off on a copy-on-write filesystem, where the zeros are only writes).
    log_preallocate_bytes: int = 4 << 20
    # Bounds on what callers can make an HTTP worker hold (docs/api.md,
    # "Bounds"): a claim answer stops growing past claim_answer_bytes (its
    # other leases are handed back); long polls waiting at once, per worker;
    # open connections per worker (more are answered 503 and closed); an
    # idle keep-alive connection is closed after keepalive_s (aiohttp's own
    # default is an hour); a request's headers must arrive within
    # header_timeout_s of its first byte (of the connection, for the first).
    claim_answer_bytes: int = 16 << 20
    max_poll_waiters: int = 512
    max_connections: int = 1024
    keepalive_s: float = 75.0
    header_timeout_s: float = 10.0
    # A fleet (docs/fleet.md): a node is out once its heartbeat is older than
    # membership_timeout_s by the database's clock; it heartbeats every
    # heartbeat_s; with peers (names or HOST:PORT addresses) it waits up to
    # peer_wait_s (issue 18: 2 minutes) to see one live before it publishes.
    membership_timeout_s: float = 10.0
    heartbeat_s: float = 1.0
    peers: tuple[str, ...] = ()
    peer_wait_s: float = 120.0
    # The shared change log keeps what a node that left or dropped out of
    # the list had not applied, for trim_hold_s after its last heartbeat: a
    # node back within it replays its own rows' changes exactly.
    trim_hold_s: float = 600.0
    defaults: RouteConfig = RouteConfig()
    routes: dict[str, RouteConfig] = field(default_factory=dict)
    jobs: dict[str, JobConfig] = field(default_factory=dict)
    config_file: Path | None = None

    @property
    def http_unix(self) -> Path | None:
        """The socket file of ``http = "unix:PATH"``; None for HOST:PORT."""
        return Path(self.http[len(UNIX_PREFIX) :]) if self.http.startswith(UNIX_PREFIX) else None

    @property
    def http_host(self) -> str:
        return self.http.rsplit(":", 1)[0].strip("[]")

    @property
    def http_port(self) -> int:
        return int(self.http.rsplit(":", 1)[1])

    @property
    def store_url(self) -> str:
        return self.store or f"sqlite:///{self.data_dir.resolve()}/schedule.db"

    def route(self, name: str) -> RouteConfig:
        """The settings of a route; a route absent from the file gets the defaults."""
        return self.routes.get(name, self.defaults)

    def to_json(self) -> dict[str, Any]:
        """A JSON form for handing the resolved configuration to children."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Path):
                value = str(value)
            elif isinstance(value, RouteConfig):
                value = dataclasses.asdict(value)
            elif f.name in ("routes", "jobs"):
                value = {k: dataclasses.asdict(v) for k, v in value.items()}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Config:
        doc = dict(doc)
        for key in ("data_dir", "tls_cert", "tls_key", "config_file"):
            if doc.get(key) is not None:
                doc[key] = Path(doc[key])
        doc["defaults"] = RouteConfig(**doc["defaults"])
        doc["routes"] = {k: RouteConfig(**v) for k, v in doc["routes"].items()}
        doc["jobs"] = {k: JobConfig(**v) for k, v in doc.get("jobs", {}).items()}
        doc["gpus"] = tuple(doc["gpus"])
        doc["peers"] = tuple(doc.get("peers", ()))
        return cls(**doc)


# Option name -> (kind, check). Kinds turn text (env, flags) into values.
_INT = "int"
_FLOAT = "float"
_DURATION = "duration"
_STR = "str"
_PATH = "path"
_GPUS = "gpus"
_PEERS = "peers"

OPTIONS: dict[str, str] = {
    "data_dir": _PATH,
    "store": _STR,
    "name": _STR,
    "http": _STR,
    "workers": _INT,
    "handler": _STR,
    "inference_procs": _INT,
    "gpus": _GPUS,
    "lease_s": _DURATION,
    "ready_size": _INT,
    "token": _STR,
    "tls_cert": _PATH,
    "tls_key": _PATH,
    "offer_timeout_s": _DURATION,
    "repeat_window_s": _DURATION,
    "ledger_group_window_s": _DURATION,
    "max_misses": _INT,
    "max_classes": _INT,
    "verify_interval_s": _DURATION,
    "drain_timeout_s": _DURATION,
    "publish_interval_s": _DURATION,
    "state_interval_s": _DURATION,
    "state_group": _STR,
    "lease_capacity": _INT,
    "batch_size": _INT,
    "handler_timeout_s": _DURATION,
    "log_fsync": _STR,
    "log_segment_bytes": _INT,
    "log_preallocate_bytes": _INT,
    "claim_answer_bytes": _INT,
    "max_poll_waiters": _INT,
    "max_connections": _INT,
    "keepalive_s": _DURATION,
    "header_timeout_s": _DURATION,
    "membership_timeout_s": _DURATION,
    "heartbeat_s": _DURATION,
    "peers": _PEERS,
    "peer_wait_s": _DURATION,
    "trim_hold_s": _DURATION,
}

# name -> the values a string option may take
_CHOICES: dict[str, tuple[str, ...]] = {
    "log_fsync": ("always", "batch", "never"),
}

# name -> (low, high) for numeric options
_RANGES: dict[str, tuple[float, float]] = {
    "workers": (1, 256),
    "inference_procs": (0, 256),
    "lease_s": (1, 86400),
    "ready_size": (1, 1_000_000),
    "offer_timeout_s": (1, 86400),
    "repeat_window_s": (3600, 30 * 86400),
    "ledger_group_window_s": (0, 1),
    "max_misses": (1, 1_000_000),
    "max_classes": (1, 1_000_000),
    "verify_interval_s": (1, 31_536_000),
    "drain_timeout_s": (0, 3600),
    "publish_interval_s": (0.01, 60),
    "state_interval_s": (0.1, 300),
    "lease_capacity": (16, 1 << 22),
    "batch_size": (1, 10_000),
    "handler_timeout_s": (1, 86_400),
    "log_segment_bytes": (4096, 1 << 34),
    "log_preallocate_bytes": (0, 1 << 34),
    "claim_answer_bytes": (64 << 10, 1 << 30),
    "max_poll_waiters": (1, 65_536),
    "max_connections": (1, 1_000_000),
    "keepalive_s": (1, 3600),
    "header_timeout_s": (1, 300),
    "membership_timeout_s": (1, 3600),
    "heartbeat_s": (0.05, 600),
    "peer_wait_s": (1, 3600),
    "trim_hold_s": (0, 86_400),
}


def _number(value: float) -> str:
    """A range's end as a person reads it: 1073741824, not 1.07374e+09."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _convert(name: str, value: Any, source: str) -> Any:  # noqa: C901 - one branch per kind
    kind = OPTIONS[name]
    try:
        if kind == _INT:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, str):
                value = int(value.strip())
            if not isinstance(value, int):
                raise ValueError
        elif kind in (_FLOAT, _DURATION):
            value = parse_duration(value, name)
        elif kind == _PATH:
            if not isinstance(value, str | Path) or not str(value):
                raise ValueError
            value = Path(value)
        elif kind == _GPUS:
            if isinstance(value, str):
                value = [v for v in value.split(",") if v.strip()]
            value = tuple(int(v) for v in value)
            if any(v < 0 for v in value):
                raise ValueError
        elif kind == _STR:
            if not isinstance(value, str):
                raise ValueError
        elif kind == _PEERS:
            value = parse_peers(value)
    except ConfigError as exc:
        raise ConfigError(str(exc), source) from None
    except (ValueError, TypeError):
        expected = {
            _INT: "an integer",
            _DURATION: "a duration like 90s, 15m, 1h or seconds",
            _PATH: "a path",
            _GPUS: "a list of GPU indexes like 0,1",
            _PEERS: "a list of node names or HOST:PORT addresses like gpu-2,10.0.0.3:8470",
            _STR: "a string",
        }[kind]
        raise ConfigError(f"{name} = {value!r} is not valid: expected {expected}", source) from None
    choices = _CHOICES.get(name)
    if choices and value not in choices:
        raise ConfigError(f"{name} = {value!r} is not one of {', '.join(choices)}", source)
    low_high = _RANGES.get(name)
    if low_high and not low_high[0] <= value <= low_high[1]:
        raise ConfigError(
            f"{name} = {value!r} is out of range: allowed {_number(low_high[0])} to "
            f"{_number(low_high[1])}",
            source,
        )
    return value


def _line_of(text: str, key: str, table: str | None = None) -> int | None:
    """Best-effort line number of ``key = …`` in a TOML file, for messages."""
    lines = text.splitlines()
    start = 0
    if table:
        for i, line in enumerate(lines):
            if re.match(rf"\s*\[\s*{re.escape(table)}\s*\]", line):
                start = i
                break
    for i in range(start, len(lines)):
        if re.match(rf"\s*\"?{re.escape(key)}\"?\s*=", lines[i]):
            return i + 1
    return None


def _route_config(
    doc: Any, base: RouteConfig, where: str, text: str, path: Path, table: str
) -> RouteConfig:
    def src(key: str) -> str:
        line = _line_of(text, key, table)
        return f"{path}:{line}" if line else str(path)

    if not isinstance(doc, dict):
        raise ConfigError(f"[{where}] must be a table", str(path))
    values = dataclasses.asdict(base)
    for key, value in doc.items():
        if key == "cadence_s":
            try:
                seconds = parse_duration(value, f"{where}.cadence_s")
            except ConfigError as exc:
                raise ConfigError(str(exc), src(key)) from None
            if not float(seconds).is_integer() or not MIN_CADENCE_S <= seconds <= MAX_CADENCE_S:
                raise ConfigError(
                    f"{where}.cadence_s = {value!r} is out of range: allowed "
                    f"{MIN_CADENCE_S} to {MAX_CADENCE_S} seconds",
                    src(key),
                )
            values["cadence_s"] = int(seconds)
        elif key == "sitemap_boost":
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (0 <= value <= 1000)
            ):
                raise ConfigError(
                    f"{where}.sitemap_boost = {value!r} is not valid: a number from 0 to 1000",
                    src(key),
                )
            values["sitemap_boost"] = float(value)
        elif key == "handler":
            if not isinstance(value, str) or ":" not in value:
                raise ConfigError(
                    f"{where}.handler = {value!r} is not valid: expected MODULE:CALLABLE",
                    src(key),
                )
            values["handler"] = value
        else:
            raise ConfigError(
                f"unknown setting {where}.{key}: allowed cadence_s, sitemap_boost, handler",
                src(key),
            )
    return RouteConfig(**values)


def _job_config(doc: Any, name: str, text: str, path: Path) -> JobConfig:
    """One ``[jobs.NAME]`` table: ``retention_s`` (a duration above 0)."""
    table = f"jobs.{name}"

    def src(key: str) -> str:
        line = _line_of(text, key, table)
        return f"{path}:{line}" if line else str(path)

    if not JOB_RE.fullmatch(name):
        raise ConfigError(f"job name {name!r} must match [A-Za-z0-9._:-]{{1,128}}", str(path))
    if not isinstance(doc, dict):
        raise ConfigError(f"[{table}] must be a table", str(path))
    retention_s = None
    for key, value in doc.items():
        if key != "retention_s":
            raise ConfigError(f"unknown setting {table}.{key}: allowed retention_s", src(key))
        try:
            retention_s = parse_duration(value, f"{table}.retention_s")
        except ConfigError as exc:
            raise ConfigError(str(exc), src(key)) from None
        if not 0 < retention_s <= MAX_RETENTION_S:
            raise ConfigError(
                f"{table}.retention_s = {value!r} is out of range: more than 0 and at most "
                f"{MAX_RETENTION_S} seconds (3650d)",
                src(key),
            )
    return JobConfig(retention_s=retention_s)


def _from_file(
    path: Path,
) -> tuple[dict[str, Any], RouteConfig, dict[str, RouteConfig], dict[str, JobConfig]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror}", str(path)) from None
    except UnicodeDecodeError:
        raise ConfigError("not valid UTF-8 (TOML files are UTF-8)", str(path)) from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib says "... (at line 2, column 11)": name the line as file:line.
        found = re.search(r"\(at line (\d+), column \d+\)$", str(exc))
        where = f"{path}:{found.group(1)}" if found else str(path)
        raise ConfigError(f"not valid TOML: {exc}", where) from None
    options: dict[str, Any] = {}
    defaults = RouteConfig()
    routes: dict[str, RouteConfig] = {}
    for key, value in doc.items():
        if key == "defaults":
            defaults = _route_config(value, RouteConfig(), "defaults", text, path, "defaults")
        elif key in ("routes", "jobs"):
            continue
        elif key in OPTIONS:
            line = _line_of(text, key)
            options[key] = _convert(key, value, f"{path}:{line}" if line else str(path))
        else:
            line = _line_of(text, key)
            raise ConfigError(
                f"unknown option {key!r}; allowed: {', '.join(sorted(OPTIONS))}, "
                "[defaults], [routes.NAME], [jobs.NAME]",
                f"{path}:{line}" if line else str(path),
            )
    route_docs = doc.get("routes", {})
    if not isinstance(route_docs, dict):
        raise ConfigError("routes must be tables: [routes.NAME]", str(path))
    for name, value in route_docs.items():
        if not name or len(name.encode()) > 128:
            raise ConfigError(f"route name {name!r} must be 1 to 128 bytes", str(path))
        routes[name] = _route_config(
            value, defaults, f"routes.{name}", text, path, f"routes.{name}"
        )
    job_docs = doc.get("jobs", {})
    if not isinstance(job_docs, dict):
        raise ConfigError("jobs must be tables: [jobs.NAME]", str(path))
    jobs = {name: _job_config(value, name, text, path) for name, value in job_docs.items()}
    return options, defaults, routes, jobs


def load_run_config(role: str) -> Config:
    """A child's configuration: the resolved JSON the supervisor wrote, named
    by QUEUE_NODE_RUN_CONFIG. ``role`` only words the error."""
    path = os.environ.get(ENV_CONFIG)
    if not path:
        raise NodeError(f"{ENV_CONFIG} is not set: the {role} is started by the node supervisor")
    try:
        with open(path, encoding="utf-8") as f:
            return Config.from_json(json.load(f))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise NodeError(f"cannot read the run configuration {path}: {exc}") from None


def load_config(
    flags: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    config_file: str | Path | None = None,
) -> Config:
    """Resolve the configuration: file < environment < flags.

    ``flags`` holds only the options the user gave (None values are ignored).
    """
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    env = dict(os.environ if env is None else env)
    path = config_file or flags.pop("config", None) or env.get(ENV_PREFIX + "CONFIG")
    values: dict[str, Any] = {}
    defaults = RouteConfig()
    routes: dict[str, RouteConfig] = {}
    jobs: dict[str, Any] = {}
    if path:
        path = Path(path)
        file_options, defaults, routes, jobs = _from_file(path)
        values.update(file_options)
        values["config_file"] = path
    for name in OPTIONS:
        var = ENV_PREFIX + name.upper()
        if var in env and env[var] != "":
            values[name] = _convert(name, env[var], var)
    for name, value in flags.items():
        if name not in OPTIONS:
            raise ConfigError(f"unknown option {name!r}")
        values[name] = _convert(name, value, "--" + name.replace("_", "-"))
    values["defaults"] = defaults
    values["routes"] = routes
    values["jobs"] = jobs
    config = Config(**values)
    return validate(config)


def validate(config: Config) -> Config:
    """Checks that span several options. Returns the config with derived
    defaults filled in (the name)."""
    name = check_name(config.name or host_node_name())
    http = _check_http(config.http)
    check_store_url(config.store_url)
    if config.gpus and config.inference_procs:
        raise ConfigError("give either --inference-procs or --gpus, not both")
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if config.token is not None and not TOKEN_RE.fullmatch(config.token):
        raise ConfigError(
            "token is not valid: 1 to 4096 visible ASCII characters, no spaces "
            "(it is sent as Authorization: Bearer <token>)"
        )
    host = None if http.startswith(UNIX_PREFIX) else http.rsplit(":", 1)[0].strip("[]")
    if host is not None and host not in ("127.0.0.1", "localhost", "::1") and not config.token:
        raise ConfigError(
            f"binding {host} needs a token: set --token or QUEUE_NODE_TOKEN "
            "(the node binds 127.0.0.1 without one)"
        )
    if config.handler is not None:
        parse_handler_spec(config.handler)
    for route_name, route in config.routes.items():
        if route.handler is None:
            continue
        parse_handler_spec(route.handler)
        if config.handler is None:
            raise ConfigError(
                f"routes.{route_name}.handler needs a default --handler too: without one "
                "no inference process starts"
            )
    check_fleet(config.membership_timeout_s, config.heartbeat_s, config.peers, name)
    timeout = config.handler_timeout_s
    if timeout is None:
        timeout = max(60.0, 10 * config.lease_s)
    return dataclasses.replace(config, name=name, http=http, handler_timeout_s=timeout)


def check_store_url(url: str) -> str:
    """A store URL's form, checked before anything starts (UnsupportedStore
    otherwise); returns it unchanged. Opening it is ``node.store.open_store``."""
    if url.startswith("memory://"):
        return url
    if url.startswith("sqlite:///"):
        if len(url) == len("sqlite:///"):
            raise UnsupportedStore(f"store URL {url!r} names no file")
        return url
    if url.startswith(("postgresql://", "postgres://")):
        return url
    raise UnsupportedStore(
        f"unknown store URL {redact_url(url)!r}: expected sqlite:///<file> or postgresql://…"
    )


# A handler: ``MODULE:CALLABLE``, dotted on both sides.
HANDLER_SPEC_RE = re.compile(
    r"([A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*):([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*)"
)


def parse_handler_spec(spec: str) -> tuple[str, str]:
    """``MODULE:CALLABLE`` → (module, attribute path); ConfigError when the
    text has another form. Whether the module exists is
    ``node.handlers.check_spec``'s question."""
    m = HANDLER_SPEC_RE.fullmatch(spec.strip()) if isinstance(spec, str) else None
    if not m:
        raise ConfigError(
            f"handler {spec!r} is not valid: expected MODULE:CALLABLE "
            "(like node.handlers:cpu_work or mypkg.models:Embedder)"
        )
    return m.group(1), m.group(2)


def _check_http(http: str) -> str:
    """``HOST:PORT``, or ``unix:PATH`` made absolute (children and node.json
    then name the same file whatever their working directory)."""
    if http.startswith(UNIX_PREFIX):
        path = http[len(UNIX_PREFIX) :]
        if not path or "\0" in path:
            raise ConfigError(f"http = {http!r} is not valid: expected unix:PATH")
        path = os.path.abspath(path)
        if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
            raise ConfigError(
                f"http = unix:{path} is too long: a socket path is at most "
                f"{MAX_UNIX_PATH_BYTES} bytes"
            )
        return UNIX_PREFIX + path
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})", http)
    if not m or int(m.group(2)) > 65535:
        raise ConfigError(f"http = {http!r} is not valid: expected HOST:PORT or unix:PATH")
    return http
