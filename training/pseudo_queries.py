"""Training queries made from a collection's own passages: each passage's title becomes a query whose one
relevant passage is that passage's text without its title (synthetic queries from the corpus, as InPars and
Promptagator generate them, taken here from the titles a scientific corpus already has):

    python -m training.pseudo_queries --corpus CORPUS.jsonl --out DIR [--min-words 4]

Reads a corpus as the index builder does (JSONL or BEIR `{"_id", "title", "text"}`; a TSV has no
titles); a passage with a title of fewer than `--min-words` words or no text is left out. Writes DIR/queries.tsv (`title:ID<TAB>title`),
DIR/qrels.txt (`title:ID 0 ID 1`) and DIR/corpus.tsv (`ID<TAB>text`: the passages without titles, so a
pair is not matched by repeating the query). No judgement is read: only the passages themselves.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from retrieval.readers import InputFileError, iter_passages

PREFIX = "title:"


def write_pseudo_queries(corpus: Path, out: Path, min_words: int = 4) -> tuple[int, int]:
    """Writes the three files; returns (queries written, passages left out)."""
    queries, qrels, passages, skipped = [], [], [], 0
    for passage in tqdm(iter_passages(corpus), desc="passages", unit=" passages"):
        title, text = " ".join(passage.title.split()), " ".join(passage.body.split())
        if len(title.split()) < min_words or not text:
            skipped += 1
            continue
        queries.append(f"{PREFIX}{passage.id}\t{title}\n")
        qrels.append(f"{PREFIX}{passage.id} 0 {passage.id} 1\n")
        passages.append(f"{passage.id}\t{text}\n")
    if not queries:
        raise InputFileError(f"{corpus}: no passage has a title of {min_words} words or more and a text")
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("queries.tsv", queries), ("qrels.txt", qrels), ("corpus.tsv", passages)):
        (out / name).write_text("".join(rows), encoding="utf-8")
    return len(queries), skipped


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.pseudo_queries", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, required=True, help="JSONL or BEIR corpus with titles")
    parser.add_argument("--out", type=Path, required=True, help="folder for queries.tsv, qrels.txt and corpus.tsv")
    parser.add_argument("--min-words", type=int, default=4, help="shortest title kept as a query (default 4)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    try:
        if args.min_words < 1:
            raise InputFileError(f"--min-words must be at least 1, got {args.min_words}")
        written, skipped = write_pseudo_queries(args.corpus, args.out, args.min_words)
    except (InputFileError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {written} title queries ({skipped} passages left out) in {args.out} "
          f"in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
