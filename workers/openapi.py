"""``GET /openapi.json``: the API as it exists in this build, hand-written.

Keep it in step with ``workers/http.py`` (``tests/test_http.py`` checks that
every route the app serves is described here) and with ``docs/api.md``.
"""

from __future__ import annotations

from typing import Any

from workers.http_errors import ERROR_CODES

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

_UNAUTHORIZED = _error_response("no or wrong token (only when the node has one)")
_BAD = _error_response("validation error; nothing changed")


def spec() -> dict[str, Any]:
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
                            {
                                "type": "object",
                                "properties": {
                                    "ok": {"const": True},
                                    "pid": {"type": "integer"},
                                    "name": {"type": "string"},
                                },
                            }
                        )
                    },
                }
            },
            "/readyz": {
                "get": {
                    "summary": "the keeper has published since the node started",
                    "responses": {
                        "200": _json({"type": "object", "properties": {"ready": {"const": True}}}),
                        "503": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "ready": {"const": False},
                                    "reason": {"type": "string"},
                                },
                            },
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
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "array",
                                    "maxItems": 10_000,
                                    "items": {"$ref": "#/components/schemas/RowWrite"},
                                }
                            },
                            "application/msgpack": {"schema": {"type": "array"}},
                        },
                    },
                    "responses": {
                        "200": _json(
                            {"type": "object", "properties": {"upserted": {"type": "integer"}}}
                        ),
                        "400": _BAD,
                        "401": _UNAUTHORIZED,
                        "413": _error_response("body over 16 MiB"),
                    },
                },
                "get": {
                    "summary": "one row, the keeper's view of it, and its lease",
                    "parameters": [
                        {
                            "name": "key",
                            "in": "query",
                            "required": True,
                            "schema": {"type": "string"},
                        }
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
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["keys"],
                                    "properties": {
                                        "keys": {
                                            "type": "array",
                                            "maxItems": 10_000,
                                            "items": {"type": "string"},
                                        }
                                    },
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": _json(
                            {"type": "object", "properties": {"deleted": {"type": "integer"}}}
                        ),
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
                "content": {
                    "application/json": {"schema": body},
                    "application/msgpack": {"schema": body},
                },
            },
            "responses": responses,
        }
    }


def _get(
    summary: str,
    params: dict[str, dict[str, Any]],
    answer: dict[str, Any],
    errors: dict[str, str],
    token: bool = False,
    path_params: tuple[str, ...] = (),
) -> dict[str, Any]:
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in path_params
    ] + [{"name": name, "in": "query", "schema": schema} for name, schema in params.items()]
    responses = {"200": _json(answer), "400": _BAD}
    if token:
        responses["401"] = _UNAUTHORIZED
    responses.update({status: _error_response(text) for status, text in errors.items()})
    op: dict[str, Any] = {"summary": summary, "parameters": parameters, "responses": responses}
    if token:
        op["security"] = [{"bearer": []}]
    return {"get": op}


_LEASE_ID = {"type": "integer", "minimum": 1}
_KEY = {"type": "string", "minLength": 1}
_LEDGER_DOWN = "ledger_unavailable: the ledger cannot be reached; retry"
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


def _work_paths() -> dict[str, Any]:
    """The work path (``workers/work_http.py``)."""
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
    poll_params = {
        "max": {"type": "integer", "minimum": 1, "maximum": 10_000, "default": 100},
        "wait_s": {"type": "number", "minimum": 0, "maximum": 60, "default": 0},
    }
    limit = {"limit": {"type": "integer", "minimum": 1, "maximum": 10_000, "default": 1000}}
    return {
        "/claim": _post(
            "lease up to max due keys, most overdue first",
            _obj(
                {
                    "max": {"type": "integer", "minimum": 1, "maximum": 10_000},
                    "lease_s": {"type": "number", "minimum": 1, "maximum": 86_400},
                    "consumer": {"type": "string", "minLength": 1, "maxLength": 128},
                },
                ("max", "consumer"),
            ),
            _obj({"leases": {"type": "array", "items": grant}}),
            {"503": "not_ready: the keeper has not published since the node started"},
        ),
        "/complete": _post(
            "a lease's result; answered once it is durable",
            _obj(
                {
                    "lease_id": _LEASE_ID,
                    "key": _KEY,
                    "result": {"description": "a JSON value; bytes: base64 with encoding"},
                    "encoding": {"const": "base64"},
                },
                ("lease_id", "key", "result"),
            ),
            _obj({"id": {"type": "integer"}}),
            {
                "409": "lease_conflict or lease_unknown",
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
            {"503": _LEDGER_DOWN},
            token=True,
            path_params=("job",),
        ),
        "/results": _get(
            "offer ready results across all jobs",
            poll_params,
            _results_answer(),
            {"503": _LEDGER_DOWN},
            token=True,
        ),
        "/jobs/{job}/ack": _post(
            "retire offered results (idempotent)",
            _obj({"ids": {"type": "array", "items": {"type": "integer"}}}, ("ids",)),
            _obj({"acked": {"type": "integer"}}),
            {"409": "never_offered: names the ids; nothing acked", "503": _LEDGER_DOWN},
        ),
        "/accounting": _get(
            "lifetime counters that must balance",
            {},
            {"type": "object"},
            {"503": _LEDGER_DOWN},
        ),
        "/admin/unhold": _post(
            "clear the hold or parking of keys",
            _obj({"keys": {"type": "array", "items": _KEY, "maxItems": 10_000}}, ("keys",)),
            _obj({"unheld": {"type": "integer"}}),
            {},
        ),
    }
