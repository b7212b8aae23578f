"""Training queries made from a collection's own passages, with no judgement read (synthetic queries from
the corpus, as InPars and Promptagator make them). Two sources:

    python -m training.pseudo_queries --corpus CORPUS.jsonl --out DIR [--min-words 4]
    python -m training.pseudo_queries --corpus CORPUS --out DIR --generator MODEL --passages N [--seed 13]
    python -m training.pseudo_queries --corpus CORPUS --out DIR --crops K [--with-titles] [--seed 13]

Titles (the first): each passage's title becomes a query whose one relevant passage is that passage's text
without its title. Reads a corpus as the index builder does (JSONL or BEIR `{"_id", "title", "text"}`; a TSV
has no titles); a passage with a title of fewer than `--min-words` words or no text is left out. Writes
DIR/queries.tsv (`title:ID<TAB>title`), DIR/qrels.txt (`title:ID 0 ID 1`) and DIR/corpus.tsv (`ID<TAB>text`:
the passages without titles, so a pair is not matched by repeating the query).

Generated (`--generator`, a generative reranker's folder): N passages drawn at random (seeded), each given the
query the model finds likeliest step by step from p(query | passage) (greedy, as InPars decodes; paper 003),
cut to its first sentence; a query of fewer than `--min-words` words is left out. Writes DIR/queries.tsv
(`gen:ID<TAB>query`) and DIR/qrels.txt (`gen:ID 0 ID 1`): their passages are the corpus's own, whole, so train
with `--corpus CORPUS`.

Cropped (`--crops K`, Contriever's independent cropping, with no generator): K spans drawn from each passage's text
(seeded), each 10% to 50% of its words (at least `--min-words`, at most MAX_CROP_WORDS), become queries whose one
relevant passage is that text, whole (with `--with-titles`, its title too, as above); a passage of fewer than
twice `--min-words` words is left out. Writes DIR/queries.tsv (`crop:ID:N<TAB>span`), DIR/qrels.txt
(`crop:ID:N 0 ID 1`) and DIR/corpus.tsv (`ID<TAB>text`, the passages without titles, as for titles).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from retrieval.readers import InputFileError, iter_passages, read_passages

PREFIX = "title:"
GENERATED = "gen:"
CROPPED = "crop:"
# The longest cropped query: past the query token limit a span would be cut anyway (20 tokens in RepBERT).
MAX_CROP_WORDS = 24


def add_title_pair(queries: list[str], qrels: list[str], passage_id: str, title: str) -> None:
    """The query line and qrels line of `title` against its passage's text."""
    queries.append(f"{PREFIX}{passage_id}\t{title}\n")
    qrels.append(f"{PREFIX}{passage_id} 0 {passage_id} 1\n")


def write_pseudo_queries(corpus: Path, out: Path, min_words: int = 4) -> tuple[int, int]:
    """Writes the three files; returns (queries written, passages left out)."""
    queries, qrels, passages, skipped = [], [], [], 0
    for passage in tqdm(iter_passages(corpus), desc="passages", unit=" passages"):
        title, text = " ".join(passage.title.split()), " ".join(passage.body.split())
        if len(title.split()) < min_words or not text:
            skipped += 1
            continue
        add_title_pair(queries, qrels, passage.id, title)
        passages.append(f"{passage.id}\t{text}\n")
    if not queries:
        raise InputFileError(f"{corpus}: no passage has a title of {min_words} words or more and a text")
    write_files(out, {"queries.tsv": queries, "qrels.txt": qrels, "corpus.tsv": passages})
    return len(queries), skipped


def write_cropped_queries(corpus: Path, out: Path, crops: int, *, min_words: int = 4, seed: int = 13,
                          titles: bool = False) -> tuple[int, int]:
    """Writes the three files of `crops` spans a passage (and, with `titles`, its title query where it has one
    of `min_words` words or more); returns (queries written, passages left out)."""
    rng = np.random.default_rng(seed)
    queries, qrels, passages, skipped = [], [], [], 0
    for passage in tqdm(iter_passages(corpus), desc="passages", unit=" passages"):
        words = passage.body.split()
        if len(words) < 2 * min_words:
            skipped += 1
            continue
        for number in range(crops):
            span = cropped(words, rng, min_words)
            queries.append(f"{CROPPED}{passage.id}:{number}\t{span}\n")
            qrels.append(f"{CROPPED}{passage.id}:{number} 0 {passage.id} 1\n")
        title = " ".join(passage.title.split())
        if titles and len(title.split()) >= min_words:
            add_title_pair(queries, qrels, passage.id, title)
        passages.append(f"{passage.id}\t{' '.join(words)}\n")
    if not queries:
        raise InputFileError(f"{corpus}: no passage has a text of {2 * min_words} words or more to crop")
    write_files(out, {"queries.tsv": queries, "qrels.txt": qrels, "corpus.tsv": passages})
    return len(queries), skipped


def cropped(words: list[str], rng: np.random.Generator, min_words: int) -> str:
    """A span of 10% to 50% of `words` (at least min_words, at most MAX_CROP_WORDS) at a random place."""
    shortest = max(min_words, round(0.1 * len(words)))
    longest = max(shortest, min(round(0.5 * len(words)), MAX_CROP_WORDS))
    length = int(rng.integers(shortest, longest + 1))
    start = int(rng.integers(0, len(words) - length + 1))
    return " ".join(words[start:start + length])


def write_files(out: Path, files: dict[str, list[str]]) -> None:
    """Each file of `out` named in `files`, its lines joined, each renamed into place whole (scifact.sh skips
    the step that writes them once qrels.txt is there)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        partial = out / f".{name}.partial"
        partial.write_text("".join(rows), encoding="utf-8")
        os.replace(partial, out / name)


SENTENCE_END = re.compile(r"(?<=[a-z0-9%)\]])\.(?=\s|[A-Z(]|$)")  # not after a capital: "S. aureus"


def first_sentence(text: str) -> str:
    """The first line of `text` up to its first full stop, whitespace collapsed."""
    line = text.strip().split("\n", 1)[0]
    end = SENTENCE_END.search(line)
    return " ".join((line[: end.end()] if end else line).split())


def write_generated_queries(corpus: Path, out: Path, generator: Path, passages: int, *, min_words: int = 4,
                            seed: int = 13, device: str = "auto", batch_size: int = 16) -> tuple[int, int]:
    """Writes DIR/queries.tsv and DIR/qrels.txt; returns (queries written, queries left out as too short)."""
    texts = read_passages(corpus)
    if not 1 <= passages <= len(texts):
        raise InputFileError(f"--passages must be between 1 and {len(texts)} (the corpus's passages), got {passages}")
    from models.generative import GenerativeReranker  # torch and transformers: only this source needs them

    model = GenerativeReranker(generator, device=device)
    ids = sorted(texts)
    chosen = drawn(ids, passages, seed)
    queries, qrels, skipped = [], [], 0
    with tqdm(total=len(chosen), desc="generating", unit=" passages") as bar:
        for start in range(0, len(chosen), batch_size):
            batch = chosen[start:start + batch_size]
            # Greedy (top_k=1), as InPars decodes; the first sentence only: a small model runs on past its claim.
            sampled = model.sample_questions([texts[pid] for pid in batch], top_k=1)
            for pid, (query,) in zip(batch, sampled):
                query = first_sentence(query)
                if len(query.split()) < min_words:
                    skipped += 1
                    continue
                queries.append(f"{GENERATED}{pid}\t{query}\n")
                qrels.append(f"{GENERATED}{pid} 0 {pid} 1\n")
            bar.update(len(batch))
    if not queries:
        raise InputFileError(f"{generator}: no generated query of {min_words} words or more")
    write_files(out, {"queries.tsv": queries, "qrels.txt": qrels})
    return len(queries), skipped


def drawn(ids: list[str], passages: int, seed: int) -> list[str]:
    """`passages` of `ids` (sorted) drawn at random, seeded, in their order."""
    return [ids[i] for i in sorted(np.random.default_rng(seed).choice(len(ids), size=passages, replace=False))]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.pseudo_queries", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, required=True, help="JSONL or BEIR corpus with titles")
    parser.add_argument("--out", type=Path, required=True, help="folder for queries.tsv, qrels.txt and corpus.tsv")
    parser.add_argument("--min-words", type=int, default=4, help="shortest title or generated query kept (default 4)")
    generated = parser.add_argument_group("generated queries")
    generated.add_argument("--generator", type=Path, help="a generative reranker's folder: queries sampled from it, "
                           "not titles")
    generated.add_argument("--passages", type=int, help="with --generator: how many passages get a query")
    generated.add_argument("--seed", type=int, default=13, help="seed of the passages drawn, and of the spans "
                           "cropped with --crops (default 13)")
    generated.add_argument("--device", default="auto", help="the generator's device: auto, cpu, cuda ... (default auto)")
    parser.add_argument("--crops", type=int, help="spans cropped from each passage as its queries, in place of "
                        "titles (Contriever's independent cropping)")
    parser.add_argument("--with-titles", action="store_true", help="with --crops: each passage's title a query too")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    try:
        if args.min_words < 1:
            raise InputFileError(f"--min-words must be at least 1, got {args.min_words}")
        if (args.generator is None) != (args.passages is None):
            raise InputFileError("--generator and --passages go together")
        if args.crops is not None and args.generator is not None:
            raise InputFileError("--crops and --generator are two sources: one at a time")
        if args.with_titles and args.crops is None:
            raise InputFileError("--with-titles adds titles to --crops; titles alone are the default source")
        if args.crops is not None:
            if args.crops < 1:
                raise InputFileError(f"--crops must be at least 1, got {args.crops}")
            written, skipped = write_cropped_queries(args.corpus, args.out, args.crops, min_words=args.min_words,
                                                     seed=args.seed, titles=args.with_titles)
            what = f"{written} cropped{' and title' if args.with_titles else ''} queries ({skipped} passages left out)"
        elif args.generator is None:
            written, skipped = write_pseudo_queries(args.corpus, args.out, args.min_words)
            what = f"{written} title queries ({skipped} passages left out)"
        else:
            written, skipped = write_generated_queries(args.corpus, args.out, args.generator, args.passages,
                                                       min_words=args.min_words, seed=args.seed, device=args.device)
            what = f"{written} generated queries ({skipped} too short, left out)"
    except (InputFileError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    elapsed = time.monotonic() - started
    print(f"wrote {what} in {args.out} in {elapsed:.1f} s ({(written + skipped) / elapsed:.2f} passages/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
