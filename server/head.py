"""``HEAD`` on every ``GET`` route: answered as ``GET`` would be, with no body.

Load balancers and ``curl -I`` probe with ``HEAD``; FastAPI's ``GET`` routes answered it
``405``. ``HeadAsGet`` routes a ``HEAD`` request as a ``GET`` and drops every body byte the
route sends. The routes whose body is large or costly (a block's frame, a prefix's frames:
fetched from disk, leased, counted as materialized) ask ``is_head`` and answer their headers
only, from the index: no frame is fetched, leased or counted, and no block is touched.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

HEAD_REQUEST = "cacheseek.head"  # in scope["extensions"]: the request came as HEAD


def is_head(request: Request) -> bool:
    return bool(request.scope.get("extensions", {}).get(HEAD_REQUEST))


class HeadAsGet:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        # A copy: the server's own scope keeps HEAD (uvicorn then sends no body, and keeps the
        # Content-Length the route set), and the middlewares outside this one label it HEAD.
        as_get = {**scope, "method": "GET", "extensions": {**(scope.get("extensions") or {}), HEAD_REQUEST: True}}
        ended = False

        async def without_body(message: dict) -> None:
            nonlocal ended
            if message["type"] == "http.response.body":
                if ended:
                    return
                ended = True
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        try:
            await self.app(as_get, receive, without_body)
        finally:
            for key in ("route", "endpoint"):  # what the router matched, for the metrics' route label
                if key in as_get:
                    scope[key] = as_get[key]
