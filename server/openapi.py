"""The OpenAPI document as the routes answer: FastAPI's, corrected in one place.

FastAPI lists a 422 on every route with a parameter, but only ``/v1/lookup`` and
``/v1/prefetch`` (which takes the lookup's body) answer 422 (a body of the wrong shape); the
others answer 400 for bad input (``server/errors.py``).
Block hashes are checked by the routes (a 400), so their pattern is stated here rather than
in ``Path(pattern=...)``, which would answer 422.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from cacheseek.hashing import HASH_HEX_PATTERN

ANSWERS_422 = {("/v1/lookup", "post"), ("/v1/prefetch", "post")}
_ERROR = {"content": {"application/json": {"schema": {"type": "object", "properties": {"error": {"type": "string"}},
                                                      "required": ["error"]}}}}
# Answers every route under /v1 may give, whatever it does.
_COMMON = {
    "400": "a bad namespace header (or a bad hash in the path)",
    "401": "tokens are configured and the request has none",
    "403": "a token that is not accepted, a read token on a write route, another tenant's namespace, or (any "
           "method but GET and HEAD) a request from a web page of another origin",
    "503": "the store is starting or shutting down",
}


def document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for path, operations in doc.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            if (path, method) not in ANSWERS_422:
                responses.pop("422", None)
            if path.startswith("/v1/"):
                for status, why in _COMMON.items():
                    responses.setdefault(status, {"description": why, **_ERROR})
            for param in op.get("parameters", []):
                if param.get("in") == "path" and param.get("name") == "hash":
                    param.setdefault("schema", {})["pattern"] = HASH_HEX_PATTERN
    schemas = doc.get("components", {}).get("schemas", {})
    if not any("422" in op.get("responses", {}) for ops in doc.get("paths", {}).values() for op in ops.values()):
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
    return doc


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
