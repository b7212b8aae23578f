"""One writer per index folder: a build, merge, update or `ann` (its `--out`), or the service taking writes over
HTTP, holds an exclusive lock on `.NAME.lock` beside `NAME`.

Two commands writing one `--out` would share its work folder (a build's `.NAME.partial/`, a merge's
`.NAME.merging/`) and end in raw SQLite errors or a mixed index; the second one fails at once
instead, naming the first one's pid. The lock is `flock(2)`'s, so the kernel drops it when its
holder exits however it exits (a crash, SIGKILL, Ctrl-C): a stale lock file locks nothing.
"""

from __future__ import annotations

import fcntl
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class InUse(ValueError):
    """Another process (or thread) writes the folder."""


# The lock files this process holds, and the thread holding each: that thread taking one again (the CLI,
# then build_index) goes on, another thread is refused as another process is.
_held: dict[Path, int] = {}


def lock_file(out: Path) -> Path:
    out = Path(os.path.abspath(out))
    return out.parent / f".{out.name}.lock"


@contextmanager
def hold(out: Path, command: str) -> Iterator[None]:
    """Holds `out`'s lock for the block, or raises InUse at once when another process holds it:
    "OUT is in use by pid N (another build)". `command` ("build", "merge") is what others are told."""
    path = lock_file(out)
    if _held.get(path) == threading.get_ident():
        yield
        return
    descriptor = _acquire(path, out, command)
    _held[path] = threading.get_ident()
    try:
        yield
    finally:
        del _held[path]
        path.unlink(missing_ok=True)  # while still locked: see _acquire for the process that opened it meanwhile
        os.close(descriptor)


def _acquire(path: Path, out: Path, command: str) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 100, 0).decode("ascii", "replace").split()
            os.close(descriptor)
            who = f"pid {holder[0]} (another {holder[1]})" if len(holder) == 2 else "another build or merge"
            raise InUse(f"{out} is in use by {who}; wait for it to end, or give another --out") from None
        try:
            current = os.stat(path).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        # The holder removed the file as it finished, after this process opened it: lock the new one.
        os.close(descriptor)
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()} {command}\n".encode(), 0)
    return descriptor
