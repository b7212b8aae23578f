"""Fine-tunes the RepBERT bi-encoder (paper 000, section 3.2) with in-batch negatives.

Each micro-batch holds `--batch-size` (query, relevant passage) pairs. Every query is
scored against every passage of the batch (Q @ P^T, eq. 3); the other pairs' passages
are its negatives, except those judged relevant to it, which count as positives; the
loss is MultiLabelMarginLoss (eq. 4), or with `--objective softmax` the cross-entropy over
the same candidates that the packaged MiniLM was trained with (see training.losses).
`--negatives N` adds N mined hard negatives per pair to the batch's passages (from
`--negatives-run`, e.g. the dense and BM25 runs of the training queries; random passages
without one); every query is scored against them too. RepBERT itself used in-batch
negatives only (N = 0, the default).

    python -m training.train_biencoder --corpus C.tsv --queries Q.tsv --qrels QRELS --output OUT
        [--negatives 1 --negatives-run DENSE.run BM25.run --negatives-depth 100]
    python -m training.train_biencoder --triples TRIPLES.tsv --output OUT

A triples file's negatives serve as the mined negatives where `--negatives` is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from models.checkpoint import padded_batch
from models.encoder import BiEncoder, default_model_path
from training.data import Collection, TrainingDataError, batch_positions, batch_rng
from training.losses import in_batch_softmax_loss, multilabel_margin_loss
from training.trainer import add_negatives_arguments, add_training_arguments, load_training_data, run_cli


class BiEncoderTrainee:
    """A BiEncoder whose weights are being fine-tuned; scores keep its pooling and normalisation."""

    def __init__(self, encoder: BiEncoder, data: Collection, batch_size: int, negatives: int, seed: int,
                 margin: float = 1.0, objective: str = "margin") -> None:
        self.encoder = encoder
        self.model = encoder.model
        self.data = data
        self.batch_size = batch_size
        self.negatives = negatives
        self.seed = seed
        self.margin = margin
        self.objective = objective

    def scores(self, queries: list[str], passages: list[str]) -> torch.Tensor:
        """Rel(q, p) for every query and passage, eq. 3, with gradients."""
        spec = self.encoder.spec
        q = self._embed(queries, "query", spec.query_max_tokens, spec.query_segment_id)
        p = self._embed(passages, "passage", spec.passage_max_tokens, spec.passage_segment_id)
        return q @ p.T

    def _embed(self, texts: list[str], input_type: str, max_tokens: int, segment_id: int) -> torch.Tensor:
        texts = self.encoder.prefixed(texts, input_type)  # e5's "query: ", ...: as indexing and serving add it
        token_ids = self.encoder.tokenizer(texts, truncation=True, max_length=max_tokens)["input_ids"]
        ids, mask = padded_batch(token_ids, self.encoder.tokenizer.pad_token_id or 0, self.encoder.device)
        return self.encoder.embed_tensor(ids, mask, segment_id)

    def loss(self, batch_index: int) -> torch.Tensor:
        positions = batch_positions(len(self.data.pairs), self.batch_size, batch_index, self.seed)
        pairs = [self.data.pairs[i] for i in positions]
        qids = [qid for qid, _ in pairs]
        candidates = [pid for _, pid in pairs]
        if self.negatives:
            rng = batch_rng(self.seed, batch_index)
            candidates += [pid for qid in qids for pid in self.data.sample_negatives(qid, self.negatives, rng)]
        positive = in_batch_positives(qids, candidates, self.data.positives).to(self.encoder.device)
        scores = self.scores([self.data.queries[qid] for qid in qids], [self.data.passages[p] for p in candidates])
        if self.objective == "softmax":
            return in_batch_softmax_loss(scores, positive)
        return multilabel_margin_loss(scores, positive, self.margin)

    def save(self, folder: Path) -> None:
        self.encoder.save(folder)


def in_batch_positives(qids: list[str], candidates: list[str], positives: dict[str, set[str]]) -> torch.Tensor:
    """mask[r, c]: candidate passage c is relevant to query r. A passage judged relevant to two queries of
    the batch is a positive in both rows, never a negative (paper 000 section 3.2)."""
    return torch.tensor([[pid in positives[qid] for pid in candidates] for qid in qids])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.train_biencoder",
        description="Fine-tune the RepBERT bi-encoder: in-batch negatives, MultiLabelMarginLoss (paper 000 eq. 4).",
    )
    parser.add_argument("--model", type=Path, default=None, help="starting checkpoint (default: the packaged MiniLM)")
    parser.add_argument("--query-max-tokens", type=int, help="default: the model's own maximum (RepBERT: 20)")
    parser.add_argument("--passage-max-tokens", type=int, help="default: the model's own maximum (RepBERT: 256)")
    parser.add_argument("--margin", type=float, default=1.0,
                        help="the hinge's margin (eq. 4: 1, for raw inner products; a cosine model such as "
                        "MiniLM, whose scores lie in [-1, 1], trains better with a smaller one, e.g. 0.1)")
    parser.add_argument("--objective", choices=("margin", "softmax"), default="margin",
                        help="margin: eq. 4's hinge (default); softmax: cross-entropy over the same candidates, "
                        "scale 20, which keeps learning once the hinge is met (--margin is then unused)")
    add_negatives_arguments(parser, 0, "mined hard negatives per pair beside the in-batch ones (default 0)")
    add_training_arguments(parser, lr=3e-6, batch_size=32, pairs="query, passage")
    return parser


def _build(args: argparse.Namespace, start: Path | None):
    if args.negatives < 0:
        raise TrainingDataError(f"--negatives must be >= 0, got {args.negatives}")
    if not 0 < args.margin < float("inf"):
        raise TrainingDataError(f"--margin must be a positive number, got {args.margin}")
    data = load_training_data(args)
    model = start or args.model or default_model_path()
    encoder = BiEncoder(
        model,
        device=args.device,
        query_max_tokens=args.query_max_tokens,
        passage_max_tokens=args.passage_max_tokens,
        batch_size=args.batch_size,
        fp16=False,
    )
    about = {"model": "biencoder", "started_from": str(args.model or default_model_path()), "pairs": len(data.pairs)}
    about["objective"] = args.objective
    if args.objective == "margin":
        about["margin"] = args.margin
    trainee = BiEncoderTrainee(encoder, data, args.batch_size, args.negatives, args.seed, args.margin, args.objective)
    return trainee, about


def main(argv: list[str] | None = None) -> int:
    return run_cli("bi-encoder", build_parser(), _build, argv)


if __name__ == "__main__":
    sys.exit(main())
