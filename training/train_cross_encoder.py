"""Fine-tunes the monoBERT cross-encoder (paper 004, section 2) with cross-entropy (eq. 1), or with
`--objective group`, a softmax over each query's positive and negatives (training.losses.group_softmax_loss).

Each micro-batch holds `--batch-size` (query, relevant passage) pairs; each brings its
positive and `--negatives` sampled negatives, so a micro-batch is
batch-size x (1 + negatives) sequences. Negatives come from, in order of preference:
the query's top-k in `--negatives-run` (a TREC run of BM25 or of our own dense
retriever: paper 000 section 4.4.3 traces lost reranking accuracy to training on one
retriever's negatives and reranking another's), the triples file's negatives, or
random corpus passages. Judged positives are never sampled as negatives.

    python -m training.train_cross_encoder --corpus C.tsv --queries Q.tsv --qrels QRELS \
        [--negatives-run RUN --negatives-depth 1000] --output OUT
    python -m training.train_cross_encoder --triples TRIPLES.tsv --output OUT

A dense run for `--negatives-run` (the retriever the reranker will serve behind):
`python -m index_builder eval --index IDX --queries Q.tsv --qrels QRELS --modes dense --runs-dir RUNS`
writes `RUNS/dense.run` (`--modes bm25` gives a BM25 run).

Training starts from `--init`, any BERT folder (default: the packaged MiniLM); a plain
encoder gets a new, randomly initialised two-label head, seeded by `--seed`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from models.cross_encoder import CrossEncoder
from models.encoder import default_model_path
from training.data import TrainingDataError
from training.losses import group_softmax_loss, relevance_cross_entropy
from training.trainer import GroupTrainee, add_negatives_arguments, add_training_arguments, load_training_data, run_cli


@dataclass
class CrossEncoderTrainee(GroupTrainee):
    """A CrossEncoder whose weights are being fine-tuned on positives and sampled negatives."""

    objective: str = "pointwise"  # or "group" (see --objective)

    def loss(self, batch_index: int) -> torch.Tensor:
        pairs, labels, sizes = [], [], []
        for query, passages in self.groups(batch_index):
            pairs += self.ranker.tokenize(query, passages)
            labels += [1] + [0] * (len(passages) - 1)
            sizes.append(len(passages))
        logits = self.ranker.logits(pairs)
        if self.objective == "group":
            return group_softmax_loss(logits, sizes)
        return relevance_cross_entropy(logits, torch.tensor(labels, device=logits.device))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.train_cross_encoder",
        description="Fine-tune the monoBERT cross-encoder with cross-entropy over positives and sampled negatives.",
    )
    parser.add_argument("--init", type=Path, default=None, help="starting BERT folder (default: the packaged MiniLM)")
    add_negatives_arguments(parser, 1, "sampled negatives per positive (default 1)")
    parser.add_argument("--objective", choices=("pointwise", "group"), default="pointwise",
                        help="pointwise: eq. 1's cross-entropy on each pair (default); group: a softmax over each "
                        "positive and its negatives (localized contrastive estimation; use several --negatives)")
    parser.add_argument("--query-max-tokens", type=int, default=64, help="query tokens kept of a pair (default 64)")
    parser.add_argument("--max-tokens", type=int, default=512,
                        help="tokens of a query-passage pair, special tokens included (default 512)")
    add_training_arguments(parser, lr=3e-6, batch_size=8, pairs="query, positive")
    return parser


def _build(args: argparse.Namespace, start: Path | None):
    if args.negatives < 1:
        raise TrainingDataError(f"--negatives must be >= 1, got {args.negatives}")
    init = args.init or default_model_path()
    torch.manual_seed(args.seed)  # a new head's initialisation
    encoder = CrossEncoder(  # first: it checks the token limits before the data is read
        start or init,
        device=args.device,
        query_max_tokens=args.query_max_tokens,
        max_tokens=args.max_tokens,
        batch_size=args.batch_size,
        fp16=False,
    )
    data = load_training_data(args)
    about = {"model": "cross-encoder", "started_from": str(init), "pairs": len(data.pairs),
             "objective": args.objective}
    return CrossEncoderTrainee(encoder, data, args.batch_size, args.negatives, args.seed, args.objective), about


def main(argv: list[str] | None = None) -> int:
    return run_cli("cross-encoder", build_parser(), _build, argv)


if __name__ == "__main__":
    sys.exit(main())
