"""Streaming readers for passage collections: TSV `id<TAB>text` and JSONL (`id`/`_id`, optional `title`, `text`,
and metadata fields: any other key, see retrieval.fields).

Lines are read one at a time in binary, each at most `max_bytes` long (a longer
line is a bad line, read past in blocks and never held), so a collection of any
size, with lines of any length, streams in bounded memory; every record comes
with its line number and its size in bytes (an interrupted build resumes at the
byte just past a record).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator, Literal, Protocol

from retrieval.fields import record_fields

CorpusFormat = Literal["tsv", "jsonl"]
BOM = b"\xef\xbb\xbf"
DEFAULT_MAX_PASSAGE_BYTES = 1 << 20  # a corpus line (TSV line or JSONL record) longer than this is a bad line
READ_BLOCK = 1 << 16  # how much of a line over the limit is read at a time while it is skipped


@dataclass(frozen=True)
class Passage:
    id: str
    text: str
    line: int
    fields: dict | None = field(default=None, hash=False)  # JSONL metadata (retrieval.fields); None: none
    title: str = field(default="", compare=False)  # JSONL's title, which `text` begins with; "" for none

    @property
    def body(self) -> str:
        """The text without its title."""
        return self.text[len(self.title):].lstrip()


@dataclass(frozen=True)
class BadLine:
    line: int
    reason: str


def detect_format(path: Path) -> CorpusFormat:
    """By suffix (.tsv / .jsonl / .json); otherwise by whether the first non-blank byte is '{'."""
    suffix = path.suffix.lower()
    if suffix in (".tsv", ".txt"):
        return "tsv"
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    with path.open("rb") as handle:
        block = handle.read(READ_BLOCK).removeprefix(BOM)  # a block at a time: the first line may be huge
        while block:
            start = block.lstrip()
            if start:
                return "jsonl" if start.startswith(b"{") else "tsv"
            block = handle.read(READ_BLOCK)
    return "tsv"


def _parse_tsv(text: str, line: int) -> Passage | BadLine | None:
    if "\t" not in text:
        return BadLine(line, "expected id<TAB>text, found no tab")
    pid, body = text.split("\t", 1)
    pid, body = pid.strip(), body.strip()
    if line == 1 and pid.lower() == "id" and body.lower() == "text":
        return None  # a header row
    if not pid:
        return BadLine(line, "empty id")
    if not body:
        return BadLine(line, f"empty text for id {pid!r}")
    return Passage(pid, body, line)


def _parse_jsonl(text: str, line: int) -> Passage | BadLine:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        return BadLine(line, f"not valid JSON ({error.msg})")
    except RecursionError:
        return BadLine(line, "JSON nested too deeply")
    if not isinstance(record, dict):
        return BadLine(line, "expected a JSON object")
    return parse_record(record, line)


def parse_record(record: dict, line: int) -> Passage | BadLine:
    """One JSONL record (`id` or `_id`, `text`, optional `title`, metadata fields) as the passage it is."""
    pid = record.get("id", record.get("_id"))
    if not isinstance(pid, (str, int)) or isinstance(pid, bool) or not str(pid).strip():
        return BadLine(line, 'missing "id" (or BEIR "_id")')
    body = record.get("text")
    title = record.get("title") or ""
    if not isinstance(body, str) or not isinstance(title, str):
        return BadLine(line, f'"text" (and "title") must be strings for id {pid!r}')
    body = " ".join(part for part in (title.strip(), body.strip()) if part)
    if not body:
        return BadLine(line, f"empty text for id {pid!r}")
    for name, value in (("id", str(pid)), ("text", body)):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:  # JSON may escape a lone surrogate, "\ud800"; no model reads it
            return BadLine(line, f"{name} is not valid Unicode text: a lone surrogate at character {error.start}")
    try:
        fields = record_fields(record)
    except ValueError as error:
        return BadLine(line, f"{error} (id {pid!r})")
    return Passage(str(pid).strip(), body, line, fields or None, title.strip())


class Digest(Protocol):
    def update(self, data: bytes, /) -> None: ...


def _lines(handle: BinaryIO, max_bytes: int, digest: Digest | None) -> Iterator[tuple[bytes | None, int, int]]:
    """(line, bytes read for it, its length without its line end) for each line from the handle's
    position; the line is None when that length is over `max_bytes`, and then it was read past in
    blocks, never held whole. `digest` gets every byte read."""
    while raw := handle.readline(max_bytes + 2):  # + 2: room for a line end ("\r\n") after max_bytes
        if digest is not None:
            digest.update(raw)
        if _without_end(raw) <= max_bytes:
            yield raw, len(raw), _without_end(raw)
            continue
        size, tail = len(raw), raw[-2:]  # the tail: a "\r\n" may span two pieces
        while not raw.endswith(b"\n") and (raw := handle.readline(READ_BLOCK)):
            if digest is not None:
                digest.update(raw)
            size, tail = size + len(raw), (tail + raw)[-2:]
        yield None, size, size - (len(tail) - _without_end(tail))


def _without_end(raw: bytes) -> int:
    """The length of a line (or of its last bytes) without its line end."""
    return len(raw) - (2 if raw.endswith(b"\r\n") else 1 if raw.endswith(b"\n") else 0)


def read_corpus(
    handle: BinaryIO, fmt: CorpusFormat, *, first_line: int = 1, max_bytes: int = DEFAULT_MAX_PASSAGE_BYTES,
    digest: Digest | None = None,
) -> Iterator[tuple[Passage | BadLine | None, int]]:
    """(record, the line's size in bytes) for each line from the handle's position; None for a blank line
    or header. A line longer than `max_bytes` bytes (its line end aside) is a BadLine, read without
    being held. `digest` (a hashlib object) gets every byte read, line ends included."""
    parse = _parse_tsv if fmt == "tsv" else _parse_jsonl
    for line, (raw, size, length) in enumerate(_lines(handle, max_bytes, digest), start=first_line):
        if raw is None:
            yield BadLine(line, f"{length} bytes, over the limit of {max_bytes} bytes a passage's line may have "
                                "(--max-passage-bytes)"), size
            continue
        try:
            text = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            yield BadLine(line, "not UTF-8"), size
            continue
        if line == 1:
            text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark is no part of the first id
        if "\r" in text:
            # Lines end at LF (or CRLF) only: a CR inside a line is most likely a file with old Mac
            # (CR-only) line endings, whose records would silently run together.
            yield BadLine(line, "carriage return inside a line: CR-only line endings? convert them to LF"), size
            continue
        yield (parse(text, line) if text.strip() else None), size
