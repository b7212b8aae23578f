"""Streaming readers for passage collections: TSV `id<TAB>text` and JSONL (`id`/`_id`, optional `title`, `text`).

Lines are read one at a time in binary, so a collection of any size streams in
constant memory and every record carries its line number and the byte offset
just past it (an interrupted build resumes from there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Literal

CorpusFormat = Literal["tsv", "jsonl"]
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Passage:
    id: str
    text: str
    line: int


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
        for raw in handle:
            if raw.strip():
                return "jsonl" if raw.removeprefix(BOM).lstrip().startswith(b"{") else "tsv"
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
    return Passage(str(pid).strip(), body, line)


def read_corpus(
    handle: BinaryIO, fmt: CorpusFormat, *, first_line: int = 1
) -> Iterator[tuple[Passage | BadLine | None, bytes]]:
    """(record, the line's raw bytes) for each line from the handle's position; None for a blank line or header."""
    parse = _parse_tsv if fmt == "tsv" else _parse_jsonl
    for line, raw in enumerate(handle, start=first_line):
        try:
            text = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            yield BadLine(line, "not UTF-8"), raw
            continue
        if line == 1:
            text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark is no part of the first id
        if "\r" in text:
            # Lines end at LF (or CRLF) only: a CR inside a line is most likely a file with old Mac
            # (CR-only) line endings, whose records would silently run together.
            yield BadLine(line, "carriage return inside a line: CR-only line endings? convert them to LF"), raw
            continue
        yield (parse(text, line) if text.strip() else None), raw
