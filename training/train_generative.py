"""Fine-tunes the generative reranker (paper 003) with MLE, LUL (eq. 4) or RLL (eq. 5).

- `--objective mle`: each micro-batch holds `--batch-size` (query, relevant passage) pairs and
  minimises -log p(query | passage); negatives are not used.
- `--objective lul`: each pair brings `--negatives` sampled negatives (default 5, as in the paper);
  likelihood on the positive's query tokens, unlikelihood on the negatives'.
- `--objective rll`: `--negatives` (default 15, as in the paper) are scored without gradients, and
  the hinge of eq. 5 (margin `--margin`) is taken against the highest-scoring one only.

Negatives come from `--negatives-run` (a TREC run), the triples file, or random corpus passages.

    python -m training.train_generative --objective rll --init MODEL_DIR \
        --corpus C.tsv --queries Q.tsv --qrels QRELS [--negatives-run RUN] --output OUT
    python -m training.train_generative --objective lul --scratch causal --corpus ... --output OUT
    python -m training.train_generative --objective mle --init DIR --gguf-file M.gguf --triples T.tsv --output OUT

`--init` is any local Hugging Face causal-LM (GPT-2 family) or seq2seq (BART family) folder, or a
GGUF file in it (`--gguf-file`); `<boq>`/`<eoq>` are added where missing. No pretrained GPT-2 or
BART ships here: `--scratch causal|seq2seq` starts from a small random model whose tokenizer is
learnt from the training passages and queries. Checkpoints are generative reranker folders.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from models.generative import GenerativeReranker, new_small_model
from training.data import TrainingDataError
from training.losses import lul_loss, mle_loss, rll_loss
from training.trainer import GroupTrainee, add_negatives_arguments, add_training_arguments, load_training_data, run_cli

OBJECTIVES = ("mle", "lul", "rll")
DEFAULT_NEGATIVES = {"mle": 0, "lul": 5, "rll": 15}


@dataclass
class GenerativeTrainee(GroupTrainee):
    """A GenerativeReranker whose language model is fine-tuned with one of the paper's objectives."""

    objective: str = "mle"
    margin: float = 1.0

    def loss(self, batch_index: int) -> torch.Tensor:
        groups = self.groups(batch_index)  # per query: its text, the positive, then the sampled negatives
        if self.objective == "rll":
            return self._rll(groups)
        pairs, labels = [], []
        for query, passages in groups:
            pairs += self.ranker.tokenize(query, passages)
            labels += [1] + [0] * (len(passages) - 1)
        logprobs, mask = self.ranker.token_logprobs(pairs)
        if self.objective == "mle":
            return mle_loss(logprobs, mask)
        return lul_loss(logprobs, mask, torch.tensor(labels, device=logprobs.device))

    def _rll(self, groups: list[tuple[str, list[str]]]) -> torch.Tensor:
        tokenized = [self.ranker.tokenize(query, passages) for query, passages in groups]
        with torch.no_grad():  # paper 003, 3.2: only the highest-scoring sampled negative updates the model
            flat = [pair for pairs in tokenized for pair in pairs[1:]]
            scores = self.ranker.log_likelihoods(flat).view(len(groups), self.negatives)
        hardest = scores.argmax(dim=1).tolist()
        chosen = [pair for pairs, h in zip(tokenized, hardest) for pair in (pairs[0], pairs[1 + h])]
        likelihoods = self.ranker.log_likelihoods(chosen).view(len(groups), 2)
        return rll_loss(likelihoods[:, 0], likelihoods[:, 1:], self.margin)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.train_generative",
        description="Fine-tune a GPT-2 / BART family model to rank passages by log p(query | passage) (paper 003).",
    )
    parser.add_argument("--objective", choices=OBJECTIVES, required=True, help="mle, lul (eq. 4) or rll (eq. 5)")
    start = parser.add_mutually_exclusive_group(required=True)
    start.add_argument("--init", type=Path, help="starting Hugging Face causal-LM or seq2seq folder")
    start.add_argument("--scratch", choices=("causal", "seq2seq"), help="start from a small random GPT-2 or BART")
    parser.add_argument("--gguf-file", help="with --init: a GGUF file inside that folder to load")
    add_negatives_arguments(parser, None, "sampled negatives per positive (lul 5, rll 15)")
    parser.add_argument("--margin", type=float, default=1.0, help="rll: the hinge margin lambda of eq. 5 (default 1)")
    parser.add_argument("--query-max-tokens", type=int, default=64, help="query tokens kept (default 64)")
    parser.add_argument("--passage-max-tokens", type=int, default=256, help="passage tokens kept (default 256)")
    scratch = parser.add_argument_group("--scratch model size")
    scratch.add_argument("--vocab-size", type=int, default=8000, help="BPE vocabulary learnt from the data")
    scratch.add_argument("--layers", type=int, default=4, help="layers (per side for seq2seq)")
    scratch.add_argument("--width", type=int, default=256, help="hidden size")
    scratch.add_argument("--heads", type=int, default=4, help="attention heads per layer")
    add_training_arguments(parser, lr=5e-5, batch_size=8, pairs="query, positive")
    return parser


def _build(args: argparse.Namespace, start: Path | None):
    negatives = DEFAULT_NEGATIVES[args.objective] if args.negatives is None else args.negatives
    if args.objective != "mle" and negatives < 1:
        raise TrainingDataError(f"--objective {args.objective} needs --negatives >= 1")
    if args.objective == "mle" and negatives:  # it would maximise their likelihood as if they were relevant
        raise TrainingDataError("--objective mle learns from relevant pairs only (eq. 2): drop --negatives")
    if args.gguf_file and not args.init:
        raise TrainingDataError("--gguf-file names a file inside --init")
    data = load_training_data(args)
    limits = dict(query_max_tokens=args.query_max_tokens, passage_max_tokens=args.passage_max_tokens)
    torch.manual_seed(args.seed)  # the new <boq>/<eoq> embeddings of a fresh start are sampled
    if start is not None:
        reranker = GenerativeReranker(start, device=args.device, fp16=False, **limits)
        origin = None  # the trainer keeps the run's origin from the checkpoint
    elif args.scratch:
        with tempfile.TemporaryDirectory() as folder:
            texts = [*data.passages.values(), *(data.queries[qid] for qid in data.positives)]  # no held-out query
            new_small_model(folder, args.scratch, texts, vocab_size=args.vocab_size, layers=args.layers,
                            width=args.width, heads=args.heads, seed=args.seed)
            reranker = GenerativeReranker(folder, device=args.device, fp16=False, **limits)
        origin = f"scratch {args.scratch}: {args.layers} layers, width {args.width}, vocabulary {args.vocab_size}"
    else:
        reranker = GenerativeReranker(args.init, device=args.device, gguf_file=args.gguf_file, fp16=False, **limits)
        origin = str(args.init / args.gguf_file) if args.gguf_file else str(args.init)
    parameters = sum(p.numel() for p in reranker.model.parameters())
    print(f"generative {reranker.architecture}: {parameters:,} parameters, objective {args.objective}", file=sys.stderr)
    about = {"model": "generative", "objective": args.objective, "started_from": origin, "pairs": len(data.pairs)}
    trainee = GenerativeTrainee(reranker, data, args.batch_size, negatives, args.seed, args.objective, args.margin)
    return trainee, about


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda args: f"generative ({args.objective})", build_parser(), _build, argv)


if __name__ == "__main__":
    sys.exit(main())
