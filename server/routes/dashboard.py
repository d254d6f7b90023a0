"""``/dashboard``: a live page over ``/v1/stats``, every asset served from the package.

The page is static (no figures in it); its script polls ``/v1/stats`` with the caller's
read token (asked for once, kept in the tab's session storage), so it shows what that
token may see. Nothing is loaded from anywhere but this server.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter, Response

from ..errors import NotFound

router = APIRouter(include_in_schema=False)

ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
# The page may load only what this server serves: a browser then refuses any other origin.
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'"


@cache
def _file(name: str) -> bytes:
    return (resources.files("cacheseek.server") / "dashboard" / name).read_bytes()


@router.get("/dashboard")
async def dashboard() -> Response:
    return Response(_file("index.html"), media_type="text/html; charset=utf-8",
                    headers={"content-security-policy": CSP, "cache-control": "no-cache"})


@router.get("/dashboard/assets/{name}")
async def asset(name: str) -> Response:
    if name not in ASSETS:
        raise NotFound(f"no asset {name!r}")
    return Response(_file(name), media_type=ASSETS[name], headers={"cache-control": "no-cache"})
