"""Errors of the HTTP API: one JSON shape, stable codes, and the middleware
that makes every failure take that shape.

Every error answer is ``{"error": {"code", "message", "field"}}``. The codes
below are the whole list (``docs/api.md`` repeats it for users); a new code
is added here first.

Rule: a request is never answered 5xx for something the caller sent. Only an
unexpected exception (a bug; its traceback is logged) becomes 500, and a
store that cannot be reached becomes 503. Everything a caller can get wrong
is caught where the request is read and raised as ``ApiError`` or
``node.core.errors.ValidationError``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from node.core.errors import StoreError, ValidationError
from node.core.log import warn

log = logging.getLogger("queue-node.http")


class _ClientParseErrors(logging.Filter):
    """aiohttp answers a request it cannot parse (a request line over 8,190
    bytes, a broken header) 400 before any handler runs, and logs it with a
    traceback on ``aiohttp.server``. That is the caller's error: one line
    without a traceback instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            message = str(exc.message)
            warn(
                "http_bad_request",
                status=exc.code,
                message=message[:200] + ("…" if len(message) > 200 else ""),
            )
            return False
        return True


def quiet_client_parse_errors() -> None:
    """Install the filter above (an HTTP worker, once at start)."""
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _ClientParseErrors) for f in server.filters):
        server.addFilter(_ClientParseErrors())


JSON_TYPE = "application/json"
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack")

# code -> (HTTP status, when). The source of the table in docs/api.md.
ERROR_CODES: dict[str, tuple[int, str]] = {
    # the request as a whole
    "invalid_json": (400, "the body is not valid JSON (or is empty, or nests too deeply)"),
    "invalid_msgpack": (400, "the body is not valid msgpack"),
    "invalid_body": (
        400,
        "the body is valid but of the wrong shape (a list where an object is expected, …)",
    ),
    "bad_request": (400, "the request could not be read (a broken chunked body, …)"),
    "missing_field": (400, "a required field or query parameter is absent"),
    "unknown_field": (400, "a field (or query parameter) the endpoint does not know"),
    "too_many_rows": (400, "more than 10,000 rows in one POST /rows"),
    "too_many_keys": (400, "more than 10,000 keys in one POST /rows/delete"),
    "too_many_classes": (400, "the write would create more than max_classes classes"),
    # one row (node.rows)
    "invalid_row": (400, "a row is not a JSON object"),
    "invalid_key": (400, "key is not a non-empty UTF-8 string of at most 1,024 bytes"),
    "invalid_route": (400, "route is not a non-empty string of at most 128 bytes"),
    "invalid_scope": (400, "scope of GET /queue-state or /accounting is other than cluster"),
    "invalid_cadence": (400, "cadence_s is not a whole number from 60 to 31,536,000"),
    "invalid_sitemap": (400, "sitemap is not true or false"),
    "invalid_due_at": (400, "due_at is not unix seconds in range"),
    "invalid_payload": (400, "payload is not a JSON value (or nests too deeply)"),
    "payload_too_large": (400, "payload is over 1 MiB encoded"),
    "invalid_job": (400, "job does not match [A-Za-z0-9._:-]{1,128}"),
    "invalid_node": (400, "node is not a node name, [A-Za-z0-9._-]{1,64}"),
    # the work path (workers/http/work.py)
    "invalid_max": (400, "max is not an integer from 1 to 10,000"),
    "invalid_lease_s": (400, "lease_s is not a number from 1 to 86,400"),
    "invalid_consumer": (400, "consumer is not a non-empty UTF-8 string of at most 128 bytes"),
    "invalid_lease_id": (400, "lease_id is not the positive integer a claim answered"),
    "invalid_result": (
        400,
        "result is not a JSON value, or its base64 (with encoding: base64) does not decode",
    ),
    "invalid_error": (400, "error is not a string"),
    "invalid_wait_s": (400, "wait_s is not a number from 0 to 60"),
    "invalid_limit": (400, "limit is not an integer from 1 to 10,000"),
    "invalid_ids": (400, "ids is not a list of non-negative integers"),
    "too_many_ids": (400, "more than 10,000 ids in one ack"),
    "too_many_items": (400, "more than 10,000 items in one POST /complete"),
    "result_too_large": (400, "a result is over the completion log's record limit (16 MiB)"),
    # the rest of HTTP
    "unauthorized": (
        401,
        "a token is configured and the request has no or a wrong Authorization: Bearer token",
    ),
    "not_found": (404, "no such path, or no such row"),
    "unknown_node": (404, "a pause or resume names a node not on the fleet's node list"),
    "method_not_allowed": (405, "the path exists but not with this method"),
    "header_timeout": (408, "the request's headers did not arrive within header_timeout_s"),
    "lease_conflict": (409, "the key was granted to another lease since this one"),
    "lease_unknown": (409, "no such lease for this key"),
    "lease_ended": (409, "release or renew of a lease that has ended (expired, released, done)"),
    "never_offered": (409, "an ack names result ids never offered; nothing was acked"),
    "body_too_large": (413, "the request body is over 16 MiB"),
    "too_many_waiters": (
        429,
        "max_poll_waiters long polls already wait in this worker; retry after Retry-After",
    ),
    "unsupported_media_type": (415, "aiohttp refused the content encoding"),
    "internal_error": (500, "a bug: the traceback is in the worker's log"),
    "store_unavailable": (503, "the durable store failed; retry later"),
    "not_ready": (503, "no claim before the keeper's first publish since the node started"),
    "not_granting": (
        503,
        "the node's grant deadline passed: it could not renew its fleet membership; retry",
    ),
    "lease_busy": (503, "another process held the key's lease slot for over 0.5 s; retry"),
    "log_unavailable": (503, "the completion log cannot take results (full disk); retry later"),
    "ledger_unavailable": (503, "the ledger process cannot be reached, or failed; retry later"),
    "peer_unavailable": (
        503,
        "?scope=cluster: a live node is missing, late or does not vouch (never a partial sum);"
        " a node a request is for is down or does not answer",
    ),
    "too_many_connections": (
        503,
        "the worker has max_connections open connections; the new one is closed",
    ),
}

# What an aiohttp HTTPException of a given status becomes.
_CODE_FOR_STATUS = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}

# Headers of an aiohttp HTTPException worth keeping on the JSON answer.
_KEEP_HEADERS = ("Allow", "WWW-Authenticate", "Retry-After")


class ApiError(Exception):
    """An error answer raised from a handler: status, code, message, field."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        assert code in ERROR_CODES, code
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers or {}


@dataclass
class Served:
    """What one worker answered, for its shutdown line."""

    requests: int = 0
    client_errors: int = 0  # 4xx
    internal_errors: int = 0  # 500: bugs, each with a logged traceback

    def count(self, status: int) -> None:
        self.requests += 1
        if 400 <= status < 500:
            self.client_errors += 1
        elif status == 500:
            self.internal_errors += 1


SERVED = web.AppKey("served", Served)
TOKEN = web.AppKey("token", str)


_REASONS = {408: "Request Timeout", 503: "Service Unavailable"}


class _JsonErrorAnswers(RequestHandler):  # type: ignore[misc]
    """aiohttp's protocol for one connection, its own error answers given
    the JSON shape. aiohttp answers a request it cannot parse (a request line
    over 8,190 bytes, a broken header) before any handler or middleware runs,
    as text/plain; the contract says every error is JSON."""

    __slots__ = ()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        answer = super().handle_error(request, status, exc, message)  # logs; refuses once sent
        code = _CODE_FOR_STATUS.get(status) or ("internal_error" if status == 500 else None)
        if code is None:  # a status with no code of ours (504 on a handler timeout)
            return answer
        if status == 500:
            text = ERROR_CODES[code][1]
        else:
            text = str(getattr(exc, "message", None) or message or ERROR_CODES[code][1])
        if len(text) > 200:
            text = text[:200] + "…"
        body = {"error": {"code": code, "message": text, "field": None}}
        response = web.Response(status=status, text=json.dumps(body), content_type=JSON_TYPE)
        response.force_close()
        return response


def json_parse_errors(protocol: RequestHandler) -> RequestHandler:
    """``protocol`` (what the runner's server made for a new connection)
    answering its own errors in JSON. The server builds aiohttp's class with
    settings of its own; the subclass adds no state (empty ``__slots__``), so
    the object takes the subclass's behaviour as it is."""
    protocol.__class__ = _JsonErrorAnswers
    return protocol


def raw_error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 error answer, for a connection the app never sees
    (refused at accept, or closed before its headers came): the usual JSON
    shape, then the connection is closed."""
    assert ERROR_CODES[code][0] == status, code
    body = json.dumps({"error": {"code": code, "message": message, "field": None}}).encode()
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {JSON_TYPE}",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


def wants_msgpack(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    return any(t in accept for t in MSGPACK_TYPES)


class Unsendable(ValueError):
    """A value an answer's encoding cannot carry ("cannot be sent in JSON:
    …"). Only what another program stored in the file can be one: the node
    refuses such values where they come in."""


def encode_answer(value: Any, raw: bool) -> bytes:
    """``value`` in msgpack (``raw``) or in strict JSON (no NaN); Unsendable
    when that encoding cannot carry it."""
    try:
        if raw:
            return msgpack.packb(value, use_bin_type=True)
        return json.dumps(value, allow_nan=False).encode()
    except (TypeError, ValueError, OverflowError) as exc:  # (UnicodeEncodeError too)
        raise Unsendable(f"cannot be sent in {'msgpack' if raw else 'JSON'}: {exc}") from None


def unsendable(value: Any, raw: bool) -> str | None:
    """Why ``value`` cannot go into an answer in msgpack (``raw``) or in
    JSON, or None."""
    try:
        encode_answer(value, raw)
    except Unsendable as exc:
        return f"it {exc}"
    return None


def reply(
    request: web.Request,
    obj: Any,
    status: int = 200,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """Answer ``obj`` as JSON, or as msgpack when the request accepts it. An
    answer msgpack cannot carry (a result with an integer past 64 bits,
    accepted before such results were refused) goes as JSON, its content
    type saying so, rather than as a 500 on every poll that reaches it."""
    if wants_msgpack(request):
        try:
            body = encode_answer(obj, raw=True)
        except Unsendable:
            pass
        else:
            return web.Response(
                body=body, status=status, content_type=MSGPACK_TYPES[0], headers=headers
            )
    return web.json_response(obj, status=status, headers=headers)


def error_reply(
    request: web.Request,
    status: int,
    code: str,
    message: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return reply(
        request, {"error": {"code": code, "message": message, "field": field}}, status, headers
    )


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> web.Response:
    code = _CODE_FOR_STATUS.get(exc.status)
    headers = {h: exc.headers[h] for h in _KEEP_HEADERS if h in exc.headers}
    if exc.status == 404:
        message = f"no such path: {request.path}"
    elif exc.status == 405:
        allowed = headers.get("Allow", "")
        message = f"{request.method} is not allowed on {request.path}; allowed: {allowed}"
    elif exc.status == 413:
        message = "the request body is over 16 MiB"
    else:
        message = exc.reason
    if code is None:
        # An aiohttp error we have no code for: keep its status (it is the
        # caller's doing when 4xx) and give it the generic code of its class.
        code = "bad_request" if exc.status < 500 else "internal_error"
    return error_reply(request, exc.status, code, message, None, headers)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: every failure becomes the JSON error shape, and every
    answer is counted."""
    try:
        response = await handler(request)
    except ApiError as exc:
        response = error_reply(request, exc.status, exc.code, exc.message, exc.field, exc.headers)
    except ValidationError as exc:
        response = error_reply(request, exc.status, exc.code, exc.message, exc.field)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # a redirect is not an error
        response = _from_http_exception(request, exc)
    except StoreError as exc:
        log.error(
            "action=store_error method=%s path=%s error=%r", request.method, request.path, str(exc)
        )
        response = error_reply(request, 503, "store_unavailable", f"the store failed: {exc}")
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("action=internal_error method=%s path=%s", request.method, request.path)
        response = error_reply(
            request, 500, "internal_error", "unexpected error; see the worker log"
        )
    request.app[SERVED].count(response.status)
    return response


# What a node with a token serves without it (CONTRACT.md, "Access"): its
# liveness, readiness and metrics, and the console's static files, none of
# which shows a key, a payload, a lease or an error. Every other route, and
# any path no route matches, needs the token: a route added anywhere is
# guarded unless it is named here.
OPEN_ROUTES: frozenset[tuple[str, str]] = frozenset(
    {
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("GET", "/metrics"),
        ("GET", "/"),
        ("GET", "/console/{name}"),
    }
)


def is_open(request: web.Request) -> bool:
    """Whether this request may go without the token (a HEAD is a GET)."""
    resource = request.match_info.route.resource
    if resource is None:  # no route matched: a 404 or 405 to come
        return False
    method = "GET" if request.method == "HEAD" else request.method
    return (method, resource.canonical) in OPEN_ROUTES


def token_matches(header: str, token: str) -> bool:
    scheme, _, supplied = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    try:
        given = supplied.strip().encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(given, token.encode("utf-8"))


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With a token configured, every request but the OPEN_ROUTES needs
    ``Authorization: Bearer <token>``. Checked before the body is read, so an
    unauthorised caller cannot make us read 16 MiB, and before the path is
    answered 404, so paths cannot be probed without it."""
    token = request.app.get(TOKEN)
    if token and not is_open(request):
        if not token_matches(request.headers.get("Authorization", ""), token):
            raise ApiError(
                401,
                "unauthorized",
                "this node needs Authorization: Bearer <token>",
                headers={"WWW-Authenticate": "Bearer"},
            )
    return await handler(request)
