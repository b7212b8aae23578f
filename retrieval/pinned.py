"""One generation of an index folder, pinned while it is read: the folder is opened once, by descriptor,
and every file of the generation is opened through that descriptor, so a writer that renames another
generation over the folder's name (index_writer.move_into_place) cannot slip its files into a load
that began before it. A loaded index opens every file it will read while it loads (no file is opened
lazily afterwards), so it serves the generation it checked, whole, until it is dropped."""

from __future__ import annotations

import os
import weakref
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

from retrieval.index_format import MANIFEST_FILE, IndexFormatError


def replaced(opened: os.stat_result, path: Path) -> bool:
    """Whether the file or folder `opened` (its stat, taken through a descriptor held open) is no longer the one
    at `path`: removed, or another put there."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return True
    return opened.st_nlink == 0 or (opened.st_dev, opened.st_ino) != (named.st_dev, named.st_ino)


class PinnedFolder:
    """`root`: where the generation's files are opened (Linux's /proc/self/fd/N, the descriptor's folder,
    whatever name it has meanwhile; where /proc is missing, the folder's path, unpinned). `index_dir`: the
    name it was opened by, for messages. The descriptor is closed when the object is collected."""

    def __init__(self, index_dir: str | Path) -> None:
        self.index_dir = Path(index_dir)
        try:
            descriptor = os.open(self.index_dir, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise IndexFormatError(f"{self.index_dir}: not an index directory (no {MANIFEST_FILE})") from None
        except OSError as error:
            raise IndexFormatError(f"{self.index_dir}: not an index directory ({error.strerror})") from None
        weakref.finalize(self, os.close, descriptor)
        pinned = Path(f"/proc/self/fd/{descriptor}")
        self.root = pinned if (pinned / ".").is_dir() else self.index_dir

    def path(self, name: str) -> Path:
        return self.root / name

    def named(self, text: str) -> str:
        """`text` (a message) with the pinned root written as the folder's name."""
        return text.replace(str(self.root), str(self.index_dir))

    @contextmanager
    def reading(self):
        """Errors raised inside name the folder, not its descriptor."""
        try:
            yield self
        except IndexFormatError as error:
            raise IndexFormatError(self.named(str(error))) from error
        except OSError as error:
            if error.filename is None:
                raise
            raise type(error)(error.errno, error.strerror, self.named(str(error.filename))) from error


def sqlite_uri(path: Path) -> str:
    """A read-only, immutable SQLite URI for `path` (no journal looked for, no lock taken: a generation's
    files never change), not resolved: resolving a pinned path would follow the folder's current name."""
    absolute = path if path.is_absolute() else Path.cwd() / path
    return f"file:{quote(str(absolute))}?mode=ro&immutable=1"
