"""Readers for SMART-format test collections (Cranfield, CISI, MED, NPL, ...) and their conversion
to the formats the builder and `eval` read (corpus TSV, queries TSV, TREC qrels).

Trap handled here: Cranfield's query `.I` numbers skip values (001, 002, 004, ...) while its
qrels number queries 1..225 in file order, so a query's id is its position in the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

FIELD = re.compile(r"^\.([A-Z])(?:\s+(.*))?$")
# Cranfield grades relevance 1 (most) to 4 (least) and -1 (no use); trec_eval wants higher = better.
CRANFIELD_GRADES = {1: 4, 2: 3, 3: 2, 4: 1}


def read_smart(path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """(`.I` value, {field letter: text}) per record, text whitespace-collapsed."""
    record_id, fields, current = None, {}, None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        match = FIELD.match(line.rstrip())
        if match and match.group(1) == "I":
            if record_id is not None:
                yield record_id, {k: " ".join(v.split()) for k, v in fields.items()}
            record_id, fields, current = (match.group(2) or "").strip(), {}, None
        elif match:
            current = match.group(1)
            fields[current] = match.group(2) or ""
        elif current is not None:
            fields[current] += " " + line
    if record_id is not None:
        yield record_id, {k: " ".join(v.split()) for k, v in fields.items()}


def document_text(fields: dict[str, str]) -> str:
    """Title then abstract, without repeating a title the abstract already starts with."""
    title, body = fields.get("T", ""), fields.get("W", "")
    return body if title and body.startswith(title) else " ".join(p for p in (title, body) if p)


def convert_cranfield(folder: Path, out: Path) -> dict[str, int]:
    """Write corpus.tsv, queries.tsv and qrels.txt (graded 4..1, -1 dropped) under `out`; return counts."""
    out.mkdir(parents=True, exist_ok=True)
    documents = 0
    with (out / "corpus.tsv").open("w", encoding="utf-8") as corpus:
        for doc_id, fields in read_smart(folder / "cran.all.1400"):
            text = document_text(fields)
            if text:
                corpus.write(f"{doc_id}\t{text}\n")
                documents += 1
    queries = 0
    with (out / "queries.tsv").open("w", encoding="utf-8") as handle:
        for position, (_, fields) in enumerate(read_smart(folder / "cran.qry"), start=1):
            handle.write(f"{position}\t{fields.get('W', '')}\n")
            queries += 1
    judgements = 0
    with (out / "qrels.txt").open("w", encoding="utf-8") as handle:
        for line in (folder / "cranqrel").read_text().splitlines():
            fields = line.split()
            if len(fields) != 3 or int(fields[2]) not in CRANFIELD_GRADES:
                continue
            handle.write(f"{fields[0]} 0 {fields[1]} {CRANFIELD_GRADES[int(fields[2])]}\n")
            judgements += 1
    return {"documents": documents, "queries": queries, "judgements": judgements}


def convert_cisi(folder: Path, out: Path) -> dict[str, int]:
    """CISI (CISI.ALL, CISI.QRY, CISI.REL: library and information science abstracts, and questions about them)
    to corpus.jsonl (BEIR's `{"_id", "title", "text"}`: titles kept apart, so they can be training pairs),
    queries.tsv (the judged questions, by their `.I`, which CISI.REL uses) and qrels.txt (each pair listed
    relevant, 1: CISI's judgements are binary); returns the counts."""
    out.mkdir(parents=True, exist_ok=True)
    documents = 0
    with (out / "corpus.jsonl").open("w", encoding="utf-8") as corpus:
        for doc_id, fields in read_smart(folder / "CISI.ALL"):
            if fields.get("W") or fields.get("T"):
                corpus.write(json.dumps({"_id": doc_id, "title": fields.get("T", ""), "text": fields.get("W", "")})
                             + "\n")
                documents += 1
    pairs = [line.split()[:2] for line in (folder / "CISI.REL").read_text().splitlines() if line.strip()]
    judged = {qid for qid, _ in pairs}
    queries = 0
    with (out / "queries.tsv").open("w", encoding="utf-8") as handle:
        for qid, fields in read_smart(folder / "CISI.QRY"):
            if qid in judged:
                handle.write(f"{qid}\t{fields.get('W', '')}\n")
                queries += 1
    (out / "qrels.txt").write_text("".join(f"{qid} 0 {doc_id} 1\n" for qid, doc_id in pairs), encoding="utf-8")
    return {"documents": documents, "queries": queries, "judgements": len(pairs)}
