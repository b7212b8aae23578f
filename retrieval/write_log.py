"""The write-ahead log of writes over HTTP: every accepted batch, appended and fsynced before it is acknowledged,
beside the index it changes (`.NAME.writes`, next to the folder `NAME`, so that a new generation swapped in
over the folder leaves it alone).

A record is one batch, whole: a header (the JSON part's length, the vectors' length, the CRC-32 of both) then
the JSON part (`{"seq": N, "upsert": [...]}` or `{"seq": N, "delete": [ids]}`) and the upserted passages' vectors
(float32, row after row). A batch is acknowledged only once its record is on disk, so a kill at any moment
loses no acknowledged batch; a record cut short by the kill (or the last one, not matching its checksum) was
never acknowledged, and `open` drops it with a log line; a damaged record with records after it is no write
cut short, and `open` refuses the log (LogCorrupt) rather than drop what follows. Compaction folds the
records up to a sequence number into a generation (whose manifest records that number) and `drop_through`
rewrites the log without them. A record the log cannot take (a full disk; the log removed or replaced under
the writer) is LogUnwritable, and nothing of it is kept.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from retrieval.pinned import replaced

log = logging.getLogger("retrieval")
HEADER = struct.Struct("<III")  # JSON bytes, vector bytes, CRC-32 of the JSON bytes then the vector bytes


def log_path(index_dir: Path) -> Path:
    index_dir = Path(os.path.abspath(index_dir))
    return index_dir.parent / f".{index_dir.name}.writes"


@dataclass(frozen=True)
class Record:
    """One batch: `seq`, and either `upsert` (passages as dicts: id, text, fields) with their `vectors`, or
    `delete` (ids)."""

    seq: int
    upsert: tuple[dict, ...] = ()
    vectors: np.ndarray | None = None
    delete: tuple[str, ...] = ()

    def encode(self) -> bytes:
        body = {"seq": self.seq, **({"upsert": list(self.upsert)} if self.upsert else {"delete": list(self.delete)})}
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        vectors = b"" if self.vectors is None else np.ascontiguousarray(self.vectors, dtype="<f4").tobytes()
        return HEADER.pack(len(payload), len(vectors), zlib.crc32(vectors, zlib.crc32(payload))) + payload + vectors

    @classmethod
    def decode(cls, payload: bytes, vectors: bytes) -> "Record":
        body = json.loads(payload)
        if "upsert" in body:
            rows = np.frombuffer(vectors, dtype="<f4").astype(np.float32).reshape(len(body["upsert"]), -1)
            return cls(body["seq"], upsert=tuple(body["upsert"]), vectors=rows)
        return cls(body["seq"], delete=tuple(body["delete"]))


class LogCorrupt(ValueError):
    """A log record that is whole but does not match its checksum, with records after it: not a write cut short,
    so nothing after it is dropped; the log is left as it is for an operator to look at."""


class LogUnwritable(OSError):
    """A record the log did not take, nothing of it kept; `errno` the system's reason where it gave one (ENOSPC:
    a full disk), and `lasting` where the log takes no record again until the writer is restarted."""

    def __init__(self, message: str, errno: int | None = None, lasting: bool = False) -> None:
        super().__init__(message)
        self.errno, self.lasting = errno, lasting


class WriteLog:
    """The log of one index, open for appending; `records` are those it held when opened (a torn tail dropped).
    Written with unbuffered system calls, so a write refused (a full disk) leaves nothing behind to be written
    later with another record."""

    def __init__(self, path: Path, records: list[Record]) -> None:
        self.path, self.records = path, records
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._broken: str | None = None  # why appends are refused for good (see `refused`)

    @property
    def refused(self) -> str | None:
        """Why the log takes no record again until the writer is restarted (a failed write it could not cut off;
        the file at its path no longer the one it writes); None while it takes them."""
        return self._broken

    @classmethod
    def open(cls, index_dir: Path) -> "WriteLog":
        """The log beside `index_dir` (created where there is none); a torn last record dropped with a log line;
        LogCorrupt for a damaged record before the end."""
        path = log_path(index_dir)
        records, end = read(path)
        if path.exists() and path.stat().st_size > end:
            log.warning("write log %s: %d bytes after byte %d are no whole record (a write cut short by a kill, "
                        "never acknowledged): dropped", path, path.stat().st_size - end, end)
            with open(path, "r+b") as handle:
                handle.truncate(end)
                os.fsync(handle.fileno())
        if not path.exists():
            path.touch()
            _fsync_folder(path.parent)
        return cls(path, records)

    @property
    def last_seq(self) -> int:
        return self.records[-1].seq if self.records else 0

    def append(self, record: Record) -> None:
        """`record` on disk (written and fsynced) in the file at the log's path when this returns; LogUnwritable
        otherwise, and then the log is as it was (a partial write is cut off, so the next record starts where a
        reader expects one; where even that fails, or the file at the path is not the one open, every later
        append is refused: `refused`)."""
        data = record.encode()
        with self._lock:
            self._check_in_place()
            start = os.lseek(self._fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
                os.fsync(self._fd)
            except OSError as error:
                try:
                    os.ftruncate(self._fd, start)
                except OSError as cut:
                    self._broken = f"a failed write ({error}) could not be cut off ({cut})"
                raise LogUnwritable(f"the write log {self.path} could not be written: {error}", error.errno,
                                    self._broken is not None) from error
            self._check_in_place()  # removed meanwhile: the record is in a file a restart never reads
            self.records.append(record)

    def _check_in_place(self) -> None:
        """LogUnwritable (lasting) where the log takes no more records: refused before, or the file open is no
        longer the one at the path (removed, or another put there), whose records a restart would not find."""
        if self._broken is None and replaced(os.fstat(self._fd), self.path):
            self._broken = ("it was removed or replaced since this writer opened it (a restart replays only what "
                            "the file now at that path holds)")
        if self._broken is not None:
            raise LogUnwritable(f"the write log {self.path} takes no more writes: {self._broken}", lasting=True)

    def drop_through(self, seq: int) -> None:
        """The log rewritten without the records up to `seq` (folded into a generation): written beside, fsynced,
        renamed over, so that a kill leaves the old log or the new one."""
        with self._lock:
            kept = [record for record in self.records if record.seq > seq]
            write_records(self.path, kept)  # a full disk: the old log stands, the copy's space freed
            os.close(self._fd)  # appends go to the new file at the log's name
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self.records = kept
            _fsync_folder(self.path.parent)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read(path: Path) -> tuple[list[Record], int]:
    """The whole records of the log at `path` (none where there is no log), and the byte where they end: a record
    cut short at the end, or the last one not matching its checksum, ends them (a write a kill cut short);
    LogCorrupt for a record not matching its checksum with more after it."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    records, at = [], 0
    while at + HEADER.size <= len(data):
        json_bytes, vector_bytes, crc = HEADER.unpack_from(data, at)
        start, end = at + HEADER.size, at + HEADER.size + json_bytes + vector_bytes
        if end > len(data):
            break
        payload, vectors = data[start:start + json_bytes], data[start + json_bytes:end]
        if zlib.crc32(vectors, zlib.crc32(payload)) != crc:
            if end < len(data):
                raise LogCorrupt(f"{path}: the record at byte {at} does not match its checksum and {len(data) - end} "
                                 "bytes follow it: not a write cut short; the log is left as it is")
            break
        records.append(Record.decode(payload, vectors))
        at = end
    return records, at


def write_records(path: Path, records: Sequence[Record], after: Path | None = None) -> None:
    """A file of `records` at `path` (a log, or a generation's sealed writes: retrieval.compaction), following the
    records of the file `after` where one is given (an earlier generation's), written beside, fsynced and renamed,
    so that the file at `path` is the old one or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as handle:
            if after is not None:
                with open(after, "rb") as earlier:
                    shutil.copyfileobj(earlier, handle)
            for record in records:
                handle.write(record.encode())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
