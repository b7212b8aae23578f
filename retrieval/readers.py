"""Readers for the files evaluation and training share: queries, qrels and run files.

Formats: queries as TSV `qid<TAB>text` or BEIR JSONL `{"_id", "text"}`; qrels as TREC
`qid 0 docid rel` or BEIR TSV `query-id<TAB>corpus-id<TAB>score` (header optional); runs in
TREC format `qid Q0 docid rank score tag`; passage collections through `retrieval.corpus`.
Every reader names the file and line of what it cannot use, in an `InputFileError`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

from retrieval.corpus import BadLine, Passage, detect_format, read_corpus

Qrels = dict[str, dict[str, int]]  # query id -> {passage id: relevance}
Run = dict[str, list[tuple[str, float]]]  # query id -> [(passage id, score)], best first


class InputFileError(ValueError):
    """A file that cannot be used; CLIs exit 2 with this one-line message."""


def lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line without its end) of each non-blank line; InputFileError if unreadable."""
    try:
        handle = path.open(encoding="utf-8-sig")  # a byte order mark is not part of the first id
    except OSError as error:
        raise InputFileError(f"{path}: cannot read ({error.strerror or error})") from None
    with handle:
        try:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, line.rstrip("\r\n")
        except UnicodeDecodeError:
            raise InputFileError(f"{path}: not UTF-8") from None


def read_queries(path: Path) -> dict[str, str]:
    """Query id -> text, in file order: TSV `qid<TAB>query` or BEIR JSONL `{"_id", "text"}`."""
    queries: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for number, line in lines(path):
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputFileError(f"{path}: line {number}: not valid JSON ({error.msg})") from None
            qid, text = record.get("_id", record.get("id")), record.get("text")
        else:
            qid, _, text = line.partition("\t")
        if qid is None or not str(qid).strip() or not isinstance(text, str) or not text.strip():
            raise InputFileError(f"{path}: line {number}: expected a query id and a non-empty query")
        qid = str(qid).strip()
        if qid in first_line:
            raise InputFileError(f"{path}: line {number}: query id {qid!r} again (first on line {first_line[qid]})")
        first_line[qid] = number
        queries[qid] = text.strip()
    if not queries:
        raise InputFileError(f"{path}: no queries")
    return queries


def read_qrels(path: Path) -> Qrels:
    """Judgements: TREC `qid 0 docid rel`, or BEIR TSV `query-id corpus-id score` (header optional)."""
    qrels: Qrels = {}
    for number, line in lines(path):
        fields = line.split()
        if number == 1 and fields[0] == "query-id":
            continue
        if len(fields) == 4:
            qid, _, docid, rel = fields
        elif len(fields) == 3:
            qid, docid, rel = fields
        else:
            raise InputFileError(f"{path}: line {number}: expected 'qid 0 docid rel' or 'qid docid rel'")
        try:
            qrels.setdefault(qid, {})[docid] = int(rel)
        except ValueError:
            raise InputFileError(f"{path}: line {number}: relevance {rel!r} is not an integer") from None
    if not qrels:
        raise InputFileError(f"{path}: no judgements")
    return qrels


def relevant(qrels: Qrels) -> dict[str, set[str]]:
    """The passages judged relevant (relevance > 0) to each query that has one."""
    found = {qid: {docid for docid, rel in judged.items() if rel > 0} for qid, judged in qrels.items()}
    return {qid: docids for qid, docids in found.items() if docids}


def read_run(path: Path, depth: int | None = None) -> Run:
    """A TREC run: each query's (passage id, score), best first, at most `depth` of them."""
    run: Run = {}
    for number, line in lines(path):
        fields = line.split()
        if len(fields) != 6:
            raise InputFileError(f"{path}: line {number}: expected 'qid Q0 docid rank score tag'")
        try:
            run.setdefault(fields[0], []).append((fields[2], float(fields[4])))
        except ValueError:
            raise InputFileError(f"{path}: line {number}: score {fields[4]!r} is not a number") from None
    if not run:
        raise InputFileError(f"{path}: empty run")
    return {qid: sorted(ranked, key=lambda hit: -hit[1])[:depth] for qid, ranked in run.items()}


def write_run(path: Path, run: Run, tag: str) -> None:
    """TREC run format: `qid Q0 docid rank score tag`; renamed into place whole, so a script that skips
    what is already there never takes an interrupted write for a finished one."""
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("w", encoding="utf-8") as handle:
        for qid, ranked in run.items():
            for rank, (docid, score) in enumerate(ranked, start=1):
                handle.write(f"{qid} Q0 {docid} {rank} {score:.6f} {tag}\n")
    os.replace(partial, path)


def iter_passages(path: Path) -> Iterator[Passage]:
    """Each passage of a whole collection (TSV or JSONL/BEIR, as the index builder reads it), in file
    order; InputFileError at the first line the index builder would refuse, a repeated id included."""
    first_line: dict[str, int] = {}
    try:
        handle = path.open("rb")
    except OSError as error:
        raise InputFileError(f"{path}: cannot read ({error.strerror or error})") from None
    with handle:
        for record, _ in read_corpus(handle, detect_format(path)):
            if isinstance(record, BadLine):
                raise InputFileError(f"{path}: line {record.line}: {record.reason}")
            if record is not None:
                if record.id in first_line:  # the index builder refuses it too
                    raise InputFileError(f"{path}: line {record.line}: passage id {record.id!r} again "
                                         f"(first on line {first_line[record.id]})")
                first_line[record.id] = record.line
                yield record


def read_passages(path: Path) -> dict[str, str]:
    """Passage id -> text of a whole collection, in memory: for training and small tools, not for
    building an index."""
    passages = {record.id: record.text for record in iter_passages(path)}
    if not passages:
        raise InputFileError(f"{path}: no passages")
    return passages
