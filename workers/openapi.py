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
        },
    }
