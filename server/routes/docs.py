"""``/docs``: Swagger UI served by the server itself, so it works on a cluster with no internet.

FastAPI's default page loads Swagger UI from a public CDN. This one is FastAPI's own
recipe for self-hosted assets: the page from ``get_swagger_ui_html``, its script and
stylesheet from the ``fastapi-offline`` package on PyPI (which ships Swagger UI 5, Apache-2.0,
built for OpenAPI 3.1), served under ``/docs/assets/``. The online validator badge is off:
it would be a request to the internet.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse

from ..errors import NotFound

router = APIRouter(include_in_schema=False)

ASSETS = {  # served name -> (file in fastapi_offline/static, media type)
    "swagger-ui-bundle.js": ("swagger-ui-bundle.js", "text/javascript"),
    "swagger-ui.css": ("swagger-ui.css", "text/css"),
    "favicon.png": ("favicon.png", "image/png"),
}


@cache
def _asset(name: str) -> bytes:
    return (resources.files("fastapi_offline") / "static" / name).read_bytes()


@router.get("/docs")
async def docs(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    app = request.app
    return get_swagger_ui_html(
        openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - API",
        oauth2_redirect_url=f"{root}/docs/oauth2-redirect",
        swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js",
        swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
        swagger_favicon_url=f"{root}/docs/assets/favicon.png",
        swagger_ui_parameters={"validatorUrl": None},
    )


@router.get("/docs/oauth2-redirect")
async def oauth2_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/docs/assets/{name}")
async def asset(name: str) -> Response:
    if name not in ASSETS:
        raise NotFound(f"no asset {name!r}")
    file, media_type = ASSETS[name]
    return Response(_asset(file), media_type=media_type, headers={"cache-control": "public, max-age=86400"})
