"""Fine-tunes the monoBERT cross-encoder (paper 004, section 2) with cross-entropy (eq. 1), with
`--objective group`, a softmax over each query's positive and negatives (training.losses.group_softmax_loss),
or with `--objective distil`, to order each training query's list as a teacher reranker scored it
(`--teacher-run`: a reranked row's run of `eval --runs-dir`; training.losses.listwise_distillation_loss),
or with `--objective residual`, the softmax over each query's positive and negatives drawn from a first
stage's list (`--prior-run`) with that first stage's z-scores, times `--prior-weight`, added to the logits:
the blend it is served in (`retrieval_weight`); 0 trains on the lists alone.

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
encoder gets a new, randomly initialised two-label head, seeded by `--seed`. `--freeze-layers N`
keeps the embeddings and the lowest N transformer layers as they start.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from models.cross_encoder import CrossEncoder
from models.encoder import default_model_path
from retrieval.readers import read_run
from training.data import TrainingDataError, prior_groups, teacher_groups
from training.losses import group_softmax_loss, listwise_distillation_loss, relevance_cross_entropy
from training.trainer import GroupTrainee, add_negatives_arguments, add_training_arguments, load_training_data, run_cli


@dataclass
class CrossEncoderTrainee(GroupTrainee):
    """A CrossEncoder whose weights are being fine-tuned on positives and sampled negatives."""

    objective: str = "pointwise"  # or "group", "distil", "residual" (see --objective)
    prior_weight: float = 1.0

    def loss(self, batch_index: int) -> torch.Tensor:
        if self.objective == "distil":
            return self._distillation_loss(batch_index)
        if self.objective == "residual":
            return self._residual_loss(batch_index)
        pairs, labels, sizes = [], [], []
        for query, passages in self.groups(batch_index):
            pairs += self.ranker.tokenize(query, passages)
            labels += [1] + [0] * (len(passages) - 1)
            sizes.append(len(passages))
        logits = self.ranker.logits(pairs)
        if self.objective == "group":
            return group_softmax_loss(logits, sizes)
        return relevance_cross_entropy(logits, torch.tensor(labels, device=logits.device))

    def _distillation_loss(self, batch_index: int) -> torch.Tensor:
        pairs, targets, sizes = [], [], []
        for query, passages, scores in teacher_groups(self.data, batch_index, self.batch_size, self.seed):
            pairs += self.ranker.tokenize(query, passages)
            targets += scores
            sizes.append(len(passages))
        logits = self.ranker.logits(pairs)
        return listwise_distillation_loss(logits, torch.tensor(targets, device=logits.device), sizes)

    def _residual_loss(self, batch_index: int) -> torch.Tensor:
        pairs, offsets, sizes = [], [], []
        for query, passages, prior in prior_groups(self.data, batch_index, self.batch_size, self.negatives, self.seed):
            pairs += self.ranker.tokenize(query, passages)
            offsets += [self.prior_weight * value for value in prior]
            sizes.append(len(passages))
        logits = self.ranker.logits(pairs)
        return group_softmax_loss(logits, sizes, torch.tensor(offsets, device=logits.device))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.train_cross_encoder",
        description="Fine-tune the monoBERT cross-encoder with cross-entropy over positives and sampled negatives.",
    )
    parser.add_argument("--init", type=Path, default=None, help="starting BERT folder (default: the packaged MiniLM)")
    add_negatives_arguments(parser, 1, "sampled negatives per positive (default 1)")
    parser.add_argument("--objective", choices=("pointwise", "group", "distil", "residual"), default="pointwise",
                        help="pointwise: eq. 1's cross-entropy on each pair (default); group: a softmax over each "
                        "positive and its negatives (localized contrastive estimation; use several --negatives); "
                        "distil: each query's list of --teacher-run ordered as the teacher scored it (a batch is "
                        "--batch-size queries); residual: group's softmax over a positive and --negatives of "
                        "--prior-run's list, each logit plus --prior-weight times the first stage's z-score (a "
                        "batch is --batch-size queries)")
    parser.add_argument("--teacher-run", type=Path, metavar="RUN",
                        help="with --objective distil: a TREC run of a teacher reranker's scores (a reranked row of "
                        "eval --runs-dir); a judged positive the run lacks joins its query's list at the best score")
    parser.add_argument("--prior-run", type=Path, metavar="RUN",
                        help="with --objective residual: a TREC run of the first stage the reranker will be blended "
                        "with, on the training queries (eval --runs-dir; its depth: the rerank depth)")
    parser.add_argument("--prior-weight", type=float, default=1.0, metavar="W",
                        help="with --objective residual: the first stage's weight in the trained blend (default 1)")
    parser.add_argument("--query-max-tokens", type=int, default=64, help="query tokens kept of a pair (default 64)")
    parser.add_argument("--max-tokens", type=int, default=512,
                        help="tokens of a query-passage pair, special tokens included (default 512)")
    parser.add_argument("--freeze-layers", type=int, default=0, metavar="N",
                        help="keep the embeddings and the lowest N transformer layers as they start (default 0: "
                        "every weight trains)")
    add_training_arguments(parser, lr=3e-6, batch_size=8, pairs="query, positive")
    return parser


def freeze_lower_layers(model: torch.nn.Module, layers: int) -> None:
    """Stops the gradient to the embeddings and the lowest `layers` transformer layers of a BERT model."""
    base = model.base_model
    if not 0 <= layers <= len(base.encoder.layer):
        raise TrainingDataError(f"--freeze-layers must be between 0 and {len(base.encoder.layer)} (the model's "
                                f"layers), got {layers}")
    if layers == 0:
        return
    for module in (base.embeddings, *base.encoder.layer[:layers]):
        module.requires_grad_(False)


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
    freeze_lower_layers(encoder.model, args.freeze_layers)
    if (args.objective == "distil") != (args.teacher_run is not None):
        raise TrainingDataError("--objective distil and --teacher-run go together")
    if (args.objective == "residual") != (args.prior_run is not None):
        raise TrainingDataError("--objective residual and --prior-run go together")
    data = load_training_data(args)
    if args.teacher_run is not None:
        covered = data.use_teacher(read_run(args.teacher_run))
        if not covered:
            raise TrainingDataError(f"{args.teacher_run}: no query of the qrels has a passage of the corpus in it")
        print(f"teacher scores from {args.teacher_run} for {covered} of {len(data.positives)} queries", file=sys.stderr)
    if args.prior_run is not None:
        covered = data.use_prior(read_run(args.prior_run))
        if not covered:
            raise TrainingDataError(f"{args.prior_run}: no query of the qrels has an unjudged passage of the corpus in it")
        print(f"first-stage lists from {args.prior_run} for {covered} of {len(data.positives)} queries", file=sys.stderr)
    about = {"model": "cross-encoder", "started_from": str(init), "pairs": len(data.pairs),
             "objective": args.objective, "frozen_layers": args.freeze_layers,
             **({"teacher_run": str(args.teacher_run)} if args.teacher_run else {}),
             **({"prior_run": str(args.prior_run), "prior_weight": args.prior_weight} if args.prior_run else {})}
    trainee = CrossEncoderTrainee(encoder, data, args.batch_size, args.negatives, args.seed, args.objective,
                                  args.prior_weight)
    return trainee, about


def main(argv: list[str] | None = None) -> int:
    return run_cli("cross-encoder", build_parser(), _build, argv)


if __name__ == "__main__":
    sys.exit(main())
