"""jemalloc in place of the C library's malloc for `python -m service`, where the system has it.

Why: under steady load glibc's heap fragments: memory in use stays flat while the heap keeps more and
more free chunks, so RSS grows; with jemalloc it stays flat, at the same throughput (see
docs/benchmarks.md, bench/overload.py). An allocator must be in place before anything allocates, so
the process executes itself again with jemalloc preloaded: same pid, same command line, one
interpreter start more. The replicas of `python -m service --ray` are processes Ray starts: they get
the preload in their environment (`worker_env`)."""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("service")

# oversize_threshold:0: no separate arena for allocations over 8 MiB, whose freed pages jemalloc hands
# back at once (the encoder's largest activations would be faulted in anew every batch); background_thread:
# pages handed back by a thread of jemalloc's own, off the requests' threads; narenas:2, as the two
# arenas the service gives glibc. MALLOC_CONF in the environment replaces it.
JEMALLOC_CONF = "oversize_threshold:0,background_thread:true,narenas:2"
# Set for the second start only: a preload that did not load never loops, and the operator's LD_PRELOAD
# is given back to the processes the service starts.
REEXECUTED = "DENSE_SEARCH_PRELOADED"


class AllocatorUnavailable(RuntimeError):
    """SEARCH_ALLOCATOR is jemalloc, and this system cannot give it."""


def jemalloc_loaded() -> bool:
    try:
        return "libjemalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def find_jemalloc() -> str | None:
    return ctypes.util.find_library("jemalloc")


def _jemalloc(allocator: str) -> str | None:
    """The jemalloc library to preload for `allocator` (auto or jemalloc; "system" is not asked), None where
    auto finds none (with a warning). Raises AllocatorUnavailable where "jemalloc" is asked for and cannot
    be had: not installed, or not Linux (where LD_PRELOAD preloads)."""
    if sys.platform != "linux":
        raise AllocatorUnavailable(f"SEARCH_ALLOCATOR is jemalloc, which is preloaded on Linux only, "
                                   f"not {sys.platform}")
    library = find_jemalloc()
    if library is None:
        if allocator == "jemalloc":
            raise AllocatorUnavailable("SEARCH_ALLOCATOR is jemalloc, but no libjemalloc is installed "
                                       "(apt-get install libjemalloc2)")
        log.warning("no libjemalloc installed: serving on the C library's malloc, whose heap fragments under "
                    "load, so RSS grows (apt-get install libjemalloc2; SEARCH_ALLOCATOR=system silences this)")
    return library


def _keeps_system(allocator: str, preloaded: str) -> bool:
    """Whether `allocator` leaves malloc as it is: "system", or auto where LD_PRELOAD names the operator's
    own preload (jemalloc preloaded first would replace their malloc) or off Linux."""
    return allocator == "system" or (allocator == "auto" and bool(preloaded or sys.platform != "linux"))


def use(allocator: str) -> str:
    """What this process allocates with, in words for the log. For "jemalloc", and for "auto" where jemalloc is
    installed, not loaded yet and LD_PRELOAD names nothing (an operator's own preload is left as it is), this
    does not return: the process is executed again with jemalloc preloaded. Raises AllocatorUnavailable as
    `_jemalloc` does."""
    if jemalloc_loaded():
        if os.environ.get(REEXECUTED) is not None:  # ours: the operator's LD_PRELOAD back for child processes
            restored = os.environ.pop(REEXECUTED)
            if restored:
                os.environ["LD_PRELOAD"] = restored
            else:
                del os.environ["LD_PRELOAD"]
        return "jemalloc, MALLOC_CONF=" + os.environ.get("MALLOC_CONF", "unset (jemalloc's defaults)")
    preloaded = os.environ.get("LD_PRELOAD", "")
    if _keeps_system(allocator, preloaded):
        return f"as LD_PRELOAD={preloaded} gives it" if preloaded else "the C library's"
    if os.environ.get(REEXECUTED) is not None:
        log.warning("jemalloc was preloaded but did not load: serving on the C library's malloc")
        return "the C library's"
    library = _jemalloc(allocator)
    if library is None:
        return "the C library's"
    environ = {**os.environ, REEXECUTED: preloaded, "LD_PRELOAD": os.pathsep.join(filter(None, [library, preloaded])),
               "MALLOC_CONF": os.environ.get("MALLOC_CONF", JEMALLOC_CONF)}
    sys.stdout.flush()
    sys.stderr.flush()
    # sys.executable as argv[0] too: CPython finds its prefix (a virtual environment's) from argv[0].
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
    raise AssertionError("unreachable")  # pragma: no cover


def worker_env(allocator: str) -> dict[str, str]:
    """The environment variables that put a Ray worker (a replica of the sharded application) on the allocator
    `allocator` names, as `use` does for `python -m service`: jemalloc preloaded by the library's name as
    found here (each node resolves the name itself; a node without it ignores the preload, and ld.so says
    so in the worker's log), ahead of an LD_PRELOAD of the operator's, with MALLOC_CONF as this process's
    environment sets it, else JEMALLOC_CONF; on glibc's malloc, two arenas (MALLOC_ARENA_MAX), as
    `python -m service` sets them. Raises AllocatorUnavailable as `_jemalloc` does."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    library = None if _keeps_system(allocator, preloaded) else _jemalloc(allocator)
    if library is None:
        return {"MALLOC_ARENA_MAX": "2"}
    return {"LD_PRELOAD": os.pathsep.join(filter(None, [library, preloaded])),
            "MALLOC_CONF": os.environ.get("MALLOC_CONF", JEMALLOC_CONF)}
