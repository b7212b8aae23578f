"""`python -m service`: serve the configured index with uvicorn (settings from SEARCH_* variables)."""

from __future__ import annotations

import logging

import uvicorn

from service.app import create_app
from service.settings import ServiceSettings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = ServiceSettings()
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                access_log=settings.access_log)


if __name__ == "__main__":
    main()
