"""How hard the pairs an unjudged recipe could hold out are (issue 78): for passages drawn from a corpus, a query
cut from each (a crop, training.pseudo_queries.cropped) and one written by the packaged SmolLM2-135M-Instruct
(training.questions: greedy, under its instruction alone or after its two hand-written examples), each searched
by BM25 over the whole corpus: where its own passage ranks. Pairs whose passage BM25 ranks first nearly always
cannot tell two models apart; a generated query BM25 cannot find at all (past 100) is the round-trip filter's
to drop.

    python bench/generated_queries.py --corpus runs/cranfield/corpus.tsv [--passages 48] [--seed 13]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import bm25s
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrieval.readers import read_passages  # noqa: E402
from training.pseudo_queries import cropped  # noqa: E402
from training.questions import Writer  # noqa: E402


def ranks(retriever: bm25s.BM25, queries: list[str], rows: list[int]) -> np.ndarray:
    """Each query's own passage's BM25 rank, 101 past the top 100."""
    found, _ = retriever.retrieve(bm25s.tokenize(queries, stopwords="en", show_progress=False), k=100,
                                  show_progress=False)
    return np.array([list(hits).index(row) + 1 if row in hits else 101 for hits, row in zip(found, rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--passages", type=int, default=48)
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args()
    passages = read_passages(args.corpus)
    ids = sorted(passages)
    texts = [passages[pid] for pid in ids]
    rng = np.random.default_rng(args.seed)
    rows = sorted(rng.choice(len(ids), size=args.passages, replace=False).tolist())
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    writer = Writer()
    sources = {"crop (10-50% of the text)": [cropped(texts[row].split(), rng, 4) for row in rows]}
    seconds = {}
    for name, few_shot in (("SmolLM2, instruction", False), ("SmolLM2, two examples", True)):
        started = time.perf_counter()
        sources[name] = writer.questions([texts[row] for row in rows], few_shot,
                                         desc="two examples" if few_shot else "instruction")
        seconds[name] = (time.perf_counter() - started) / len(rows)
    print(f"\n{args.passages} passages of {args.corpus} ({len(ids):,}), each query's own passage ranked by BM25:\n")
    print("| query | top 1 | top 10 | past 100 | seconds a query | e.g. |")
    print("|---|---:|---:|---:|---:|---|")
    for name, queries in sources.items():
        found = ranks(retriever, queries, rows)
        cost = f"{seconds[name]:.2f}" if name in seconds else "-"
        print(f"| {name} | {np.mean(found == 1):.3f} | {np.mean(found <= 10):.3f} | {np.mean(found > 100):.3f} | "
              f"{cost} | {queries[0][:60]} |")


if __name__ == "__main__":
    main()
