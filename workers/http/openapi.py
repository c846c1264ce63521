# Over 650 lines: one hand-written description of the whole API (split, shared parts scatter).
"""``GET /openapi.json``: the API as it exists in this build, hand-written.

Keep it in step with ``workers/http/app.py`` (``tests/integration/test_http.py`` checks that
every route the app serves is described here) and with ``docs/api.md``.
"""

from __future__ import annotations

from typing import Any

from workers.http.errors import ERROR_CODES, OPEN_ROUTES

_ERROR = {"$ref": "#/components/schemas/Error"}


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR}}}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ROW_FIELDS: dict[str, Any] = {
    "key": {"type": "string", "minLength": 1, "description": "at most 1,024 bytes UTF-8"},
    "route": {"type": "string", "minLength": 1, "description": "at most 128 bytes"},
    "cadence_s": {
        "type": ["integer", "null"],
        "minimum": 60,
        "maximum": 31_536_000,
        "description": "absent or null: the route's default",
    },
    "sitemap": {"type": "boolean", "default": False},
    "due_at": {"type": "number", "description": "unix seconds; default now (on insert)"},
    "payload": {"description": "any JSON value, at most 1 MiB encoded"},
    "job": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$", "default": "default"},
}

_LEASE_ID = {"type": "integer", "minimum": 1, "maximum": (1 << 64) - 1}
_KEY = {"type": "string", "minLength": 1, "description": "at most 1,024 bytes UTF-8"}
_JOB = {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"}
# Result ids are SQLite rowids; a larger one was never offered (409).
_RESULT_ID = {"type": "integer", "minimum": 0, "maximum": (1 << 63) - 1}
_UNAUTHORIZED = _error_response("no or wrong token (only when the node has one)")
_BAD = _error_response("validation error; nothing changed")


def spec(token: bool = True) -> dict[str, Any]:
    """The document. ``token``: the node has one, so every operation but
    ``OPEN_ROUTES`` (health, readiness, metrics, the console's files) needs
    ``Authorization: Bearer``; without one nothing does, and the document
    says so (a client, or a fuzzer, then sends no credentials)."""
    doc = _document()
    if not token:
        doc["security"] = [{}]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if token and (method.upper(), path) not in OPEN_ROUTES:
                op["security"] = [{"bearer": []}]
                op["responses"].setdefault("401", _UNAUTHORIZED)
            else:
                op["security"] = [{}]
                op["responses"].pop("401", None)
    return doc


def _document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "queue-node",
            "version": "0.1.0",
            "description": (
                "A per-host scheduler node. Bodies are JSON, or msgpack when Content-Type is "
                "application/msgpack; answers are msgpack when Accept says so. Every error "
                'is {"error": {code, message, field}}; codes: '
                + ", ".join(sorted(ERROR_CODES))
                + "."
            ),
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["code", "message", "field"],
                            "properties": {
                                "code": {"type": "string", "enum": sorted(ERROR_CODES)},
                                "message": {"type": "string"},
                                "field": {"type": ["string", "null"]},
                            },
                        }
                    },
                },
                "RowWrite": {
                    "type": "object",
                    "required": ["key", "route"],
                    "additionalProperties": False,
                    "properties": _ROW_FIELDS,
                },
                "Row": {
                    "type": "object",
                    "properties": {**_ROW_FIELDS, "version": {"type": "integer"}},
                },
            },
        },
        "security": [{}, {"bearer": []}],
        "paths": {
            "/healthz": {
                "get": {
                    "summary": "the worker is up",
                    "responses": {
                        "200": _json(
                            _obj(
                                {
                                    "ok": {"const": True},
                                    "pid": {"type": "integer"},
                                    "name": {"type": "string"},
                                }
                            )
                        )
                    },
                }
            },
            "/readyz": {
                "get": {
                    "summary": (
                        "the keeper has published since the node started and the ledger answers"
                    ),
                    "responses": {
                        "200": _json({"type": "object", "properties": {"ready": {"const": True}}}),
                        "503": _json(
                            _obj({"ready": {"const": False}, "reason": {"type": "string"}}),
                            "not ready yet, with the reason",
                        ),
                    },
                }
            },
            "/rows": {
                "post": {
                    "summary": "upsert rows (at most 10,000; a batch with one bad row is "
                    "refused whole)",
                    "security": [{"bearer": []}],
                    "requestBody": {
                        "required": True,
                        "content": _bodies(
                            {
                                "type": "array",
                                "maxItems": 10_000,
                                "items": {"$ref": "#/components/schemas/RowWrite"},
                            }
                        ),
                    },
                    "responses": {
                        "200": _json(_obj({"upserted": {"type": "integer"}})),
                        "400": _BAD,
                        "401": _UNAUTHORIZED,
                        "413": _error_response("body over 16 MiB"),
                    },
                },
                "get": {
                    "summary": "one row, the keeper's view of it, and its lease",
                    "parameters": [
                        {"name": "key", "in": "query", "required": True, "schema": _KEY}
                    ],
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "row": {"$ref": "#/components/schemas/Row"},
                                    "keeper": {"type": "object"},
                                    "lease": {"type": ["object", "null"]},
                                },
                            }
                        ),
                        "400": _BAD,
                        "404": _error_response("no such row"),
                    },
                },
            },
            "/rows/delete": {
                "post": {
                    "summary": "delete rows by key (at most 10,000)",
                    "security": [{"bearer": []}],
                    "requestBody": {
                        "required": True,
                        "content": _bodies(
                            _obj(
                                {"keys": {"type": "array", "maxItems": 10_000, "items": _KEY}},
                                ("keys",),
                            )
                        ),
                    },
                    "responses": {
                        "200": _json(_obj({"deleted": {"type": "integer"}})),
                        "400": _BAD,
                        "401": _UNAUTHORIZED,
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "this description",
                    "responses": {"200": _json({"type": "object"})},
                }
            },
            **_work_paths(),
            **_state_paths(),
            **_page_paths(),
        },
    }


def _text(media_type: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}


def _page_paths() -> dict[str, Any]:
    """The console (docs/console.md) and the Prometheus scrape (docs/metrics.md)."""
    return {
        "/": {
            "get": {
                "summary": "the console",
                "responses": {"200": _text("text/html", "the console page")},
            }
        },
        "/console/{name}": {
            "get": {
                "summary": "the console's files",
                "parameters": [
                    {
                        "name": "name",
                        "in": "path",
                        "required": True,
                        "schema": {
                            "type": "string",
                            "enum": ["index.html", "console.js", "console.css"],
                        },
                    }
                ],
                "responses": {
                    "200": {
                        "description": "the file",
                        "content": {
                            media_type: {"schema": {"type": "string"}}
                            for media_type in ("text/html", "text/javascript", "text/css")
                        },
                    },
                    "404": _error_response("no such file"),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus text format, every process of the node",
                "responses": {"200": _text("text/plain", "the metrics")},
            }
        },
    }


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = list(required)
    return out


def _post(
    summary: str,
    body: dict[str, Any],
    answer: dict[str, Any],
    errors: dict[str, str],
) -> dict[str, Any]:
    responses = {"200": _json(answer), "400": _BAD, "401": _UNAUTHORIZED}
    responses.update({status: _error_response(text) for status, text in errors.items()})
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}],
            "requestBody": {
                "required": True,
                "content": _bodies(body),
            },
            "responses": responses,
        }
    }


def _bodies(schema: dict[str, Any]) -> dict[str, Any]:
    """A request body's media types: JSON, or msgpack with the same shape.
    Every endpoint refuses a field it does not know (unknown_field): an
    object body is closed."""
    if schema.get("type") == "object":
        schema = {**schema, "additionalProperties": False}
    return {"application/json": {"schema": schema}, "application/msgpack": {"schema": schema}}


def _get(
    summary: str,
    params: dict[str, dict[str, Any]],
    answer: dict[str, Any],
    errors: dict[str, str],
    path_params: tuple[str, ...] = (),
) -> dict[str, Any]:
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": _JOB} for name in path_params
    ] + [{"name": name, "in": "query", "schema": schema} for name, schema in params.items()]
    responses = {"200": _json(answer), "400": _BAD}
    responses.update({status: _error_response(text) for status, text in errors.items()})
    return {"get": {"summary": summary, "parameters": parameters, "responses": responses}}


_LEDGER_DOWN = "ledger_unavailable: the ledger cannot be reached; retry"
_WAITERS = "too_many_waiters: max_poll_waiters long polls wait already (wait_s > 0); retry"
_LEASE_409 = "lease_conflict, lease_unknown or lease_ended"


def _results_answer() -> dict[str, Any]:
    item = _obj(
        {
            "id": {"type": "integer"},
            "key": {"type": "string"},
            "job": {"type": "string"},
            "result": {"description": "the JSON value, or base64 text with encoding"},
            "encoding": {"const": "base64", "description": "present only for bytes"},
            "finished_at": {"type": "number"},
        }
    )
    return _obj({"results": {"type": "array", "items": item}})


# POST /complete: one completion, or {"items": [...]} of them (at most 10,000).
_COMPLETION = {
    **_obj(
        {
            "lease_id": _LEASE_ID,
            "key": _KEY,
            "result": {"description": "a JSON value; bytes: base64 with encoding, raw in msgpack"},
            "encoding": {"const": "base64"},
        },
        ("lease_id", "key", "result"),
    ),
    "additionalProperties": False,
}
_COMPLETIONS = _obj({"items": {"type": "array", "minItems": 1, "maxItems": 10_000}}, ("items",))
_COMPLETIONS["properties"]["items"]["items"] = _COMPLETION
_OUTCOME = _obj({"id": _RESULT_ID, "outcome": {"enum": ["ok", "repeat", "conflict", "unknown"]}})


def _work_paths() -> dict[str, Any]:
    """The work path (``workers/http/work.py``)."""
    grant = _obj(
        {
            "lease_id": _LEASE_ID,
            "key": {"type": "string"},
            "payload": {},
            "job": {"type": "string"},
            "due_at": {"type": "number"},
            "expires_at": {"type": "number"},
        }
    )
    poll_params: dict[str, dict[str, Any]] = {
        "max": {"type": "integer", "minimum": 1, "maximum": 10_000, "default": 100},
        "wait_s": {"type": "number", "minimum": 0, "maximum": 60, "default": 0},
        "scope": {"enum": ["cluster"], "description": "cluster: every live node of a fleet"},
    }
    limit = {"limit": {"type": "integer", "minimum": 1, "maximum": 10_000, "default": 1000}}
    return {
        "/claim": _post(
            "lease up to max due keys, most overdue first; the answer stops at claim_answer_bytes",
            _obj(
                {
                    "max": {"type": "integer", "minimum": 1, "maximum": 10_000},
                    "lease_s": {"type": "number", "minimum": 1, "maximum": 86_400},
                    "consumer": {"type": "string", "minLength": 1, "maxLength": 128},
                },
                ("max", "consumer"),
            ),
            _obj({"leases": {"type": "array", "items": grant}}),
            {"503": "not_ready: no publish since the node started; not_granting: see fleet.md"},
        ),
        "/complete": _post(
            "a lease's result, or {items: [...]} of them; answered once durable",
            {"oneOf": [_COMPLETION, {**_COMPLETIONS, "additionalProperties": False}]},
            _obj(
                {
                    "id": {"type": ["integer", "null"]},
                    "items": {"type": "array", "items": _OUTCOME},
                }
            ),
            {
                "409": "lease_conflict or lease_unknown (single form; items have outcomes)",
                "503": "log_unavailable (retry later) or " + _LEDGER_DOWN,
            },
        ),
        "/release": _post(
            "hand a lease back without a result (a miss)",
            _obj(
                {"lease_id": _LEASE_ID, "key": _KEY, "error": {"type": "string"}},
                ("lease_id", "key"),
            ),
            _obj({"released": {"const": True}}),
            {"409": _LEASE_409, "503": "lease_busy: retry"},
        ),
        "/renew": _post(
            "extend a live lease to now + lease_s",
            _obj(
                {
                    "lease_id": _LEASE_ID,
                    "key": _KEY,
                    "lease_s": {"type": "number", "minimum": 1, "maximum": 86_400},
                },
                ("lease_id", "key", "lease_s"),
            ),
            _obj({"expires_at": {"type": "number"}}),
            {"409": _LEASE_409, "503": "lease_busy: retry"},
        ),
        "/leases": _get(
            "the live leases, oldest grant first",
            limit,
            _obj({"leases": {"type": "array", "items": {"type": "object"}}}),
            {},
        ),
        "/held": _get(
            "held and parked keys, parked first",
            limit,
            _obj({"held": {"type": "array", "items": {"type": "object"}}}),
            {},
        ),
        "/jobs/{job}/results": _get(
            "offer up to max ready results of the job (long poll up to wait_s)",
            poll_params,
            _results_answer(),
            {"429": _WAITERS, "503": _LEDGER_DOWN},
            path_params=("job",),
        ),
        "/results": _get(
            "offer ready results across all jobs",
            poll_params,
            _results_answer(),
            {"429": _WAITERS, "503": _LEDGER_DOWN},
        ),
        "/jobs/{job}/ack": _post(
            "retire offered results (idempotent)",
            _obj(
                {
                    "ids": {"type": "array", "items": _RESULT_ID, "maxItems": 10_000},
                    "check": {"type": "boolean", "description": "check only: nothing acked"},
                },
                ("ids",),
            ),
            _obj({"acked": {"type": "integer"}, "checked": {"type": "integer"}}),
            {
                "409": "never_offered: names the ids; nothing acked",
                "503": _LEDGER_DOWN + "; peer_unavailable: a node holding some ids is down",
            },
        ),
        "/accounting": _get(
            "lifetime counters that must balance",
            {"scope": {"enum": ["cluster"], "description": "absent: this node"}},
            {"type": "object"},
            {"503": _LEDGER_DOWN + "; peer_unavailable (scope=cluster): a node is missing"},
        ),
        "/admin/unhold": _post(
            "clear the hold or parking of keys",
            _obj({"keys": {"type": "array", "items": _KEY, "maxItems": 10_000}}, ("keys",)),
            _obj({"unheld": {"type": "integer"}}),
            {},
        ),
    }


def _queue_state_schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the 200 answer, the 503 answer) of GET /queue-state; docs/api.md
    describes every field."""
    count = {"type": "integer", "minimum": 0}
    maybe_count = {"type": ["integer", "null"], "minimum": 0}
    kinds = _obj({"sitemap": count, "discovered": count, "total": count})
    paused = _obj(
        {"node": {"type": "boolean"}, "routes": {"type": "array", "items": {"type": "string"}}},
        ("node", "routes"),
    )
    bins = {"type": "array", "items": count, "minItems": 6, "maxItems": 6}
    identity = {
        "route": {"type": "string"},
        "cadence_s": {"type": "integer"},
        "source": {"enum": ["route", "row"]},
        "sitemap": {"type": "boolean"},
        "boost": {"type": "number"},
    }
    trust = {
        "type": "object",
        "required": ["vouched", "live", "reason", "status"],
        "properties": {
            "vouched": {"type": "boolean"},
            "live": {"type": "boolean"},
            "reason": {"type": ["string", "null"], "description": "why not vouched"},
            "status": {"type": ["string", "null"]},
            "phase": {"type": ["string", "null"]},
            "exact": {"type": "boolean"},
            "counts_at": {"type": ["number", "null"]},
            "state_age_s": {"type": ["number", "null"]},
            "heartbeat_age_s": {"type": ["number", "null"]},
            "load": {"type": "object"},
            "publish": {"type": "object"},
            "verify": {"type": "object"},
            "repairs": _obj({"total": count, "membership": count, "feed_missed": count}),
            "apply": {"type": "object"},
            "lag": {"type": "object"},
            "feed_seq": {"type": "integer"},
            # ?scope=cluster (docs/fleet.md, "The fleet as one")
            "missing": {"type": "array", "items": {"type": "string"}},
            "nodes": {
                "type": "object",
                "description": "scope=cluster: each live node's verdict and own figures, by name",
            },
            "down": {
                "type": ["array", "null"],
                "description": "scope=cluster: the nodes on the node list that are not live",
                "items": _obj(
                    {
                        "name": {"type": "string"},
                        "address": {"type": "string"},
                        "number": {"type": "integer"},
                        "heartbeat_age_s": {"type": "number"},
                        "state": {"enum": ["lapsed", "left"]},
                    }
                ),
            },
        },
    }
    scope = {
        "scope": {"const": "cluster", "description": "only with ?scope=cluster"},
        "nodes": {"type": "array", "items": {"type": "string"}},
    }
    vouched = _obj(
        {
            "now": _obj(
                {
                    "at": {"type": "number", "description": "the counts' time"},
                    "due": kinds,
                    "in_flight": maybe_count,
                    "unclaimed": {**maybe_count, "description": "an estimate"},
                    "held": maybe_count,
                    "parked": maybe_count,
                    "rows": count,
                    "classes": count,
                    "paused": paused,
                    "paused_nodes": {"type": "array", "items": {"type": "string"}},
                    "status": {"type": "string"},
                }
            ),
            "coming": _obj(
                {
                    "15m": count,
                    "60m": count,
                    "24h": count,
                    "by_hour": {"type": "array", "items": count, "minItems": 24, "maxItems": 24},
                }
            ),
            "lateness": _obj(
                {
                    "edges": {"type": "array", "items": {"type": "number"}},
                    "labels": {"type": "array", "items": {"type": "string"}},
                    "sitemap": bins,
                    "discovered": bins,
                    "total": bins,
                    "by_route": {"type": "object", "additionalProperties": bins},
                    "by_route_truncated": {"type": "boolean"},
                    "oldest": {
                        "type": "array",
                        "items": _obj(
                            {
                                **identity,
                                "due": count,
                                "oldest_due_minute": {"type": "integer"},
                                "lateness_s": {"type": "number"},
                                "lateness_ratio": {"type": "number"},
                            }
                        ),
                    },
                    "oldest_truncated": {"type": "boolean"},
                }
            ),
            "flow": _obj(
                {
                    "minutes": {"type": "array", "items": {"type": "object"}},
                    "last_hour": {"type": "object"},
                }
            ),
            "classes": _obj(
                {
                    "rows": {
                        "type": "array",
                        "items": _obj(
                            {
                                **identity,
                                "rows": count,
                                "due": count,
                                "oldest_due_minute": {"type": ["integer", "null"]},
                                "oldest_lateness_ratio": {"type": ["number", "null"]},
                            }
                        ),
                    },
                    "truncated": {"type": "boolean"},
                }
            ),
            "counters": _obj({"received": count}),
            "trust": trust,
            **scope,
        },
        ("now", "coming", "lateness", "flow", "trust"),
    )
    refused = _obj(
        {
            "now": _obj(
                {
                    "in_flight": maybe_count,
                    # null: a cluster that could not be asked whole
                    "paused": {"anyOf": [paused, {"type": "null"}]},
                    "status": {"type": ["string", "null"]},
                },
                ("in_flight", "paused", "status"),
            ),
            "trust": trust,
            **scope,
        },
        ("now", "trust"),
    )
    return vouched, refused


def _state_paths() -> dict[str, Any]:
    """Queue state and pausing (``workers/http/state.py``)."""
    vouched, refused = _queue_state_schemas()
    state = _get(
        "the queue's state: counts the keeper vouches for, lease figures read now",
        {"scope": {"enum": ["cluster"], "description": "absent: this node"}},
        vouched,
        {},
    )
    state["get"]["responses"]["503"] = _json(
        refused, "the keeper cannot vouch (trust.reason says why): no counts"
    )
    route = {"type": "string", "minLength": 1, "description": "at most 128 bytes"}
    node = {
        "type": "string",
        "pattern": "^[A-Za-z0-9._-]{1,64}$",
        "description": "another node of the fleet (asked through this one); not with route",
    }
    pause_body = _obj({"route": route, "node": node})
    pause_body["additionalProperties"] = False
    paused = _obj(
        {
            "paused": _obj(
                {
                    "node": {"type": "boolean"},
                    "routes": {"type": "array", "items": {"type": "string"}},
                }
            ),
            "applied": {"type": "boolean", "description": "the keeper confirmed a republish"},
            "node": {"type": "string", "description": "the node whose pause this is"},
        }
    )
    pause_errors = {
        "404": "unknown_node: no node of that name on the fleet's node list",
        "503": "peer_unavailable: the node named is down or does not answer",
    }
    run_now_body = {
        "oneOf": [
            _obj({"route": route}, ("route",)),
            _obj({"job": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"}}, ("job",)),
        ]
    }
    return {
        "/queue-state": state,
        "/admin/pause": _post(
            "stop granting a route's rows ({route}; on a fleet, every node's), every row of "
            "this node ({}) or of another node of the fleet ({node}); survives a restart",
            pause_body,
            paused,
            pause_errors,
        ),
        "/admin/resume": _post(
            "grant a route's rows ({route}), this node's ({}) or another node's ({node}) again",
            pause_body,
            paused,
            pause_errors,
        ),
        "/admin/run-now": _post(
            "every row of a route or job due now (on a fleet, every node's); a row already "
            "due keeps its due time; counted as updated in the flow",
            run_now_body,
            _obj({"rescheduled": {"type": "integer", "minimum": 0}}),
            {},
        ),
    }
