"""`python -m service`: serve the configured index with uvicorn (settings from SEARCH_* variables)."""

from __future__ import annotations

import logging
import sys

import uvicorn
from pydantic import ValidationError

from service.admission import header_timeout_protocol
from service.app import create_app
from service.settings import ServiceSettings


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = ServiceSettings()
    except ValidationError as error:  # one line per bad setting, named as its variable
        for problem in error.errors():
            name = "SEARCH_" + "_".join(str(part) for part in problem["loc"]).upper()
            print(f"error: {name}: {problem['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                access_log=settings.access_log, http=header_timeout_protocol(settings.read_timeout_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
