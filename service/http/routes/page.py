"""The search page at `/`: HTML (service/http/page.html), its CSS and script (service/http/static), no build step
and nothing fetched from elsewhere. The page holds no data, so it is served without the API key; every call
it makes (/search) needs the key like any client's, and /ready (open) tells it about the index."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from service.settings import ServiceSettings

SERVICE = Path(__file__).resolve().parents[1]
PAGE = SERVICE / "page.html"  # a template, so not among the static files
STATIC = SERVICE / "static"
# Scripts, styles and fetches from this origin only; no frames.
SECURITY_HEADERS = {"content-security-policy": "default-src 'self'; frame-ancestors 'none'",
                    "x-content-type-options": "nosniff"}


def mount_page(app: FastAPI, settings: ServiceSettings) -> None:
    """Serve the page at `/` and its files under `/static/`."""
    # The page shows its key field from the start when the service has a key.
    html = PAGE.read_text().replace(
        "{{KEY_REQUIRED}}", "true" if settings.api_key is not None else "false")

    @app.get("/", include_in_schema=False, response_class=HTMLResponse)
    async def search_page() -> HTMLResponse:
        return HTMLResponse(html, headers=SECURITY_HEADERS)

    app.mount("/static", SecureStaticFiles(directory=STATIC), name="static")


class SecureStaticFiles(StaticFiles):
    """The page's files, with the page's security headers."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(SECURITY_HEADERS)
        return response
