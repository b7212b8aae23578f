"""`python -m service`: serve the configured index with uvicorn (settings from SEARCH_* variables)."""

from __future__ import annotations

import argparse
import ctypes
import logging
import sys

from pydantic import ValidationError

from service.engine import allocator
from service.settings import ServiceSettings

M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives each thread that allocates its own malloc arena, up to 8 per core, and freed memory
    stays in them: under steady load (event loop, model thread, FAISS and OpenMP threads) RSS creeps up;
    with two arenas it grows far less (see docs/benchmarks.md, bench/overload.py; what remains is the
    heap fragmenting, which jemalloc avoids: service/engine/allocator.py). The same as MALLOC_ARENA_MAX=2;
    under jemalloc it sets what nobody uses, and off glibc nothing happens."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, arenas)
    except (OSError, AttributeError):
        pass


DESCRIPTION = ("Serve SEARCH_INDEX_DIR with uvicorn; with --ray, serve the shards of one build (--shards N, or "
               "--shard i/N jobs) on Ray Serve. Every other setting is a SEARCH_* variable.")


def _ray_parser() -> argparse.ArgumentParser:
    """The plain parser without -h, which only says whether --ray is given (its --help is then the Ray one)."""
    parser = argparse.ArgumentParser(prog="python -m service", add_help=False, description=DESCRIPTION)
    parser.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                        help="serve --shards on Ray Serve (python -m service --ray --help for its options)")
    return parser


def build_parser(ray: bool = False) -> argparse.ArgumentParser:
    """The flags of `python -m service`, or with `ray` those of `python -m service --ray` (imports Ray)."""
    if ray:
        from service.sharded import command

        parser = argparse.ArgumentParser(prog="python -m service --ray", description=DESCRIPTION)
        command.add_arguments(parser)
        return parser
    parser = _ray_parser()
    parser.add_argument("-h", "--help", action="help", help="show this help message and exit")
    return parser


def main(argv: list[str] | None = None, *, reexec: bool = False) -> int:
    """`reexec`: may this process be executed again, with jemalloc preloaded (SEARCH_ALLOCATOR)? Only
    when it is `python -m service` or the `dense-search` script (`cli`), never a program calling main."""
    # Ray is imported only with --ray: the plain service never loads it.
    parser = build_parser(ray=_ray_parser().parse_known_args(argv)[0].ray is not None)
    args = parser.parse_args(argv)
    limit_malloc_arenas()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # FAISS logs each optimised build it tries and cannot load (AVX-512, ...) at INFO: normal, and alarming.
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    try:
        settings = ServiceSettings()
    except ValidationError as error:  # one line per bad setting, named as its variable
        for problem in error.errors():
            name = "SEARCH_" + "_".join(str(part) for part in problem["loc"]).upper()
            print(f"error: {name}: {problem['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    if args.ray is not None:
        from service.sharded import command

        return command.serve_sharded(args, settings)
    # Before the service's imports (torch, FAISS, uvicorn): executed again with jemalloc, they would load twice.
    try:
        malloc = allocator.use(settings.allocator if reexec else "system")  # in words, for the log
    except allocator.AllocatorUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    import uvicorn

    from service.engine.tracing import TracingUnavailable
    from service.http.app import create_app
    from service.http.keys import KeysFileError
    from service.http.protocol import timeout_protocol

    logging.getLogger("service").info("malloc: %s", malloc)
    try:
        app = create_app(settings)
    except (TracingUnavailable, KeysFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    protocol = timeout_protocol(settings.read_timeout_s, settings.write_timeout_s, app.state.occupancy,
                                max_head_bytes=settings.max_head_bytes, max_headers=settings.max_headers)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info", access_log=settings.access_log,
                http=protocol, timeout_graceful_shutdown=settings.drain_timeout_s)
    return 0


def cli() -> int:
    """`python -m service` and the `dense-search` script."""
    return main(reexec=True)


if __name__ == "__main__":
    sys.exit(cli())
