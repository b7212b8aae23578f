"""The corpus file a build reads: refused before any work unless it is a regular file, and checked at
the end to be the very bytes the build read, so a corpus edited during a build never makes a mixed index."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from tqdm import tqdm

from index_builder.errors import BuildError

HASH_BLOCK = 1 << 22
_KINDS = {stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a character device",
          stat.S_ISBLK: "a block device"}


def check_corpus_file(corpus: Path) -> os.stat_result:
    """The corpus's stat, or BuildError when it is missing, a folder or not a regular file. By `os.stat`,
    before anything opens it: opening a FIFO would wait for a writer."""
    try:
        found = os.stat(corpus)
    except FileNotFoundError:
        raise BuildError(f"{corpus}: corpus file not found") from None
    if stat.S_ISDIR(found.st_mode):
        raise BuildError(f"corpus {corpus} is a directory, not a file")
    if not stat.S_ISREG(found.st_mode):
        kind = next((name for test, name in _KINDS.items() if test(found.st_mode)), "something else")
        raise BuildError(f"corpus {corpus} is not a regular file ({kind})")
    return found


def check_unchanged(corpus: Path, opened: os.stat_result, sha256: str, work: Path) -> None:
    """BuildError unless `corpus` is still the file opened (`opened`: its fstat when the build opened it)
    with the same size and modification time, and its bytes, read again, have the `sha256` of those the
    build read."""
    change = _change(corpus, opened, sha256)
    if change:
        raise BuildError(f"corpus {corpus} changed during the build ({change}), so no index was written; "
                         f"rebuild: the partial build in {work} is kept, resumed where its corpus is unchanged "
                         "(else --restart)")


def _change(corpus: Path, opened: os.stat_result, sha256: str) -> str | None:
    try:
        now = os.stat(corpus)
    except FileNotFoundError:
        return "it was removed"
    if (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
        return "it was replaced by another file"
    if now.st_size != opened.st_size:
        return f"its size went from {opened.st_size} to {now.st_size} bytes"
    if now.st_mtime_ns != opened.st_mtime_ns:
        return "it was written to: its modification time moved"
    if file_sha256(corpus) != sha256:
        return "its bytes differ from those read: another sha256"
    return None


def file_sha256(path: Path) -> str:
    """sha256 of the file's bytes, read in blocks, with a progress bar (a corpus may be large)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle, tqdm(desc="checking the corpus", unit="B", unit_scale=True,
                                         total=os.fstat(handle.fileno()).st_size) as progress:
        for block in iter(lambda: handle.read(HASH_BLOCK), b""):
            digest.update(block)
            progress.update(len(block))
    return digest.hexdigest()


def count_lines(corpus: Path) -> int:
    """The corpus's lines, counted in blocks (a pass at disk speed, cheap next to encoding): the
    progress bar's total, which blank lines and a header make a little too high."""
    lines, last = 0, b"\n"
    with corpus.open("rb") as handle:
        while block := handle.read(HASH_BLOCK):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")
