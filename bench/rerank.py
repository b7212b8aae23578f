"""Cross-encoder scoring: our length-sorted batches against a naive loop, and rerank ms per query.

    python bench/rerank.py [--model DIR] [--pairs 512] [--depths 100 1000] [--queries 3]

The model defaults to a monoBERT-shaped cross-encoder made from the packaged MiniLM (6 layers,
384 wide, random 2-label head: no trained cross-encoder weights ship here; speed does not depend on
the head). Part 1 scores the same (query, passage) pairs from the demo collection with
`CrossEncoder.score` and with a naive loop (file order, each batch padded to its longest pair) and
prints pairs/s and the ratio. Part 2 times reranking the dense top-`depth` for a few demo queries
through `SearchEngine` (retrieval reported apart) on `--index` (the demo index; built if missing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from index_builder.build import BuildOptions, build_index  # noqa: E402
from models.cross_encoder import CrossEncoder, relevance_probability  # noqa: E402
from models.encoder import BiEncoder, default_model_path  # noqa: E402
from retrieval.load_options import LoadOptions  # noqa: E402
from service.engine.search_engine import SearchEngine  # noqa: E402

DEMO = ROOT / "data" / "demo"


def minilm_cross_encoder(folder: Path) -> Path:
    from transformers import AutoTokenizer, BertForSequenceClassification

    BertForSequenceClassification.from_pretrained(default_model_path(), num_labels=2).save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(folder)
    return folder


def naive_scores(model: CrossEncoder, query: str, passages: list[str], batch_size: int) -> np.ndarray:
    """The baseline: pairs in the given order, each batch padded to its longest, same truncation."""
    out = []
    with torch.inference_mode():
        for start in range(0, len(passages), batch_size):
            batch = model.tokenizer([query] * len(passages[start : start + batch_size]),
                                    passages[start : start + batch_size], padding=True,
                                    truncation="only_second", max_length=model.max_tokens, return_tensors="pt")
            logits = model.model(**{k: v.to(model.device) for k, v in batch.items()}).logits
            out.append(relevance_probability(logits).cpu().numpy())
    return np.concatenate(out)


def bench_scoring(model: CrossEncoder, pairs: int) -> None:
    passages = [line.split("\t", 1)[1] for line in (DEMO / "corpus.tsv").read_text().splitlines()[:pairs]]
    query = "Return the absolute version of a path."
    model.score(query, passages[:32])
    naive_scores(model, query, passages[:32], model.batch_size)  # warm-up both
    started = time.perf_counter()
    naive = naive_scores(model, query, passages, model.batch_size)
    naive_rate = len(passages) / (time.perf_counter() - started)
    started = time.perf_counter()
    ours = model.score(query, passages)
    ours_rate = len(passages) / (time.perf_counter() - started)
    agree = float(np.abs(ours - naive).max())
    print(f"\n{'scoring':<34}{'pairs/s':>10}")
    print(f"{'naive loop (file order)':<34}{naive_rate:>10.1f}")
    print(f"{'CrossEncoder.score (length-sorted)':<34}{ours_rate:>10.1f}")
    print(f"sorted / naive = {ours_rate / naive_rate:.2f}x over {len(passages)} demo pairs, batch {model.batch_size} "
          f"(max |score difference| {agree:.1e})")


def bench_rerank(model: CrossEncoder, index: Path, depths: list[int], queries: int) -> None:
    questions = [line.split("\t", 1)[1] for line in (DEMO / "queries.tsv").read_text().splitlines()[:queries]]
    if not (index / "manifest.json").is_file():
        print(build_index(BuildOptions(DEMO / "corpus.tsv", index), BiEncoder(device="cpu")).summary())
    engine = SearchEngine(SearchEngine.open(index, load=LoadOptions(device="cpu")).searcher, {"monobert": model})
    print(f"\n{'depth':>6}{'retrieve ms':>14}{'rerank ms/query':>18}{'pairs/s':>10}")
    for depth in depths:
        retrieve, rerank = [], []
        for question in questions:
            timings = engine.search(question, 10, rerank_depth=depth).timings
            retrieve.append(timings.encode + timings.retrieve)
            rerank.append(timings.rerank)
        ms = statistics.median(rerank)
        print(f"{depth:>6}{statistics.median(retrieve):>14.1f}{ms:>18.1f}{1000 * depth / ms:>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="cross-encoder checkpoint (default: MiniLM-shaped, random head)")
    parser.add_argument("--index", type=Path, default=ROOT / "indexes" / "demo", help="built from the demo if missing")
    parser.add_argument("--pairs", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--depths", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--queries", type=int, default=3, help="queries timed per depth (median reported)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or minilm_cross_encoder(Path(tmp) / "minilm-monobert")
        model = CrossEncoder(folder, device="cpu", batch_size=args.batch_size)
        print(f"model: {folder.name}, {sum(p.numel() for p in model.model.parameters()) / 1e6:.1f}M parameters, "
              f"{torch.get_num_threads()} threads")
        bench_scoring(model, args.pairs)
        bench_rerank(model, args.index, args.depths, args.queries)


if __name__ == "__main__":
    main()
