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
# Headers a client sends so that the server counts its traffic per model and in tokens
# (docs/operations.md, "Models"): a client generated from the document without them shows
# under the model "" with no token figures.
_TRAFFIC_HEADERS = {
    "X-CacheSeek-Model": ("the model this traffic is counted under (RemoteCache sends its model_id); absent: \"\"",
                          {"type": "string"}),
    "X-CacheSeek-Block-Tokens": ("tokens in a block, so that blocks are counted as tokens too",
                                 {"type": "integer", "minimum": 1}),
}
_LOOKUP_HEADERS = {
    "X-CacheSeek-Tokens": ("the query's length in tokens (its partial last block included), the token hit rate's "
                           "denominator; for several chains, one number per chain, comma-separated",
                           {"type": "string", "pattern": "^[0-9]+(,[0-9]+)*$"}),
    "X-CacheSeek-Continues": ("on a piece of a chain looked up in pieces (past max_lookup_hashes): its first block's "
                              "position; the query is counted once, by its first piece", {"type": "integer", "minimum": 1}),
    "X-CacheSeek-Again": ("1: a lookup sent again for a query counted already (counted nothing)",
                          {"type": "integer", "enum": [1]}),
}
_COUNTED = {("/v1/blocks/{hash}", "put"), ("/v1/blocks", "post"), ("/v1/blocks/{hash}", "get"),
            ("/v1/prefixes/{hash}", "get"), ("/v1/lookup", "post")}
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
            if (path, method) in _COUNTED:
                headers = {**_TRAFFIC_HEADERS, **(_LOOKUP_HEADERS if path == "/v1/lookup" else {})}
                params = op.setdefault("parameters", [])
                named = {p.get("name") for p in params}
                params += [{"name": name, "in": "header", "required": False, "description": why, "schema": schema}
                           for name, (why, schema) in headers.items() if name not in named]
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
