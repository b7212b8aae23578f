"""The fine-tuning loop shared by both BERT trainers: AdamW, linear warm-up then linear decay,
gradient accumulation, atomic checkpoints every N steps, and exact resume.

A checkpoint is `OUTPUT/checkpoint-NNNNNNN/`: a model folder the service loads as is,
plus `trainer_state.json` (step and settings) and `training_state.pt` (optimizer and
scheduler state, which loaders of the model ignore). Batches and dropout are seeded by
step, so a resumed run continues exactly where the interrupted one stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm
from transformers import get_linear_schedule_with_warmup

from retrieval.readers import read_run
from training.data import Collection, TrainingDataError, load_collection, pool_runs, sampled_groups
from training.split import read_withheld

CHECKPOINT_PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "training_state.pt"
# Settings that fix the batch order or the optimiser's (the learning rate comes back with the saved
# scheduler, so another --lr would be silently ignored); a resume with other values would not continue
# the same run. --max-steps may grow: the run is extended, its warm-up and decay recomputed to the new end.
RESUME_MUST_MATCH = ("batch_size", "accumulate", "seed", "lr", "weight_decay")


class Trainee(Protocol):
    """One model being fine-tuned: its parameters, a loss per micro-batch, and how it saves itself."""

    model: torch.nn.Module

    def loss(self, batch_index: int) -> torch.Tensor: ...

    def save(self, folder: Path) -> None: ...


@dataclass
class GroupTrainee:
    """A reranker trained on groups: each (query, relevant passage) pair of a micro-batch with
    `negatives` sampled negatives. Subclasses turn `groups(batch_index)` into a loss."""

    ranker: Any  # CrossEncoder, CoAttentionReranker or GenerativeReranker: each has save(folder)
    data: Collection
    batch_size: int
    negatives: int
    seed: int

    @property
    def model(self) -> torch.nn.Module:
        return self.ranker.model

    def groups(self, batch_index: int) -> list[tuple[str, list[str]]]:
        return sampled_groups(self.data, batch_index, self.batch_size, self.negatives, self.seed)

    def save(self, folder: Path) -> None:
        self.ranker.save(folder)


@dataclass(frozen=True)
class TrainSettings:
    output: Path
    max_steps: int
    batch_size: int
    accumulate: int
    lr: float
    warmup_steps: int
    weight_decay: float
    max_grad_norm: float
    save_every: int
    keep_checkpoints: int
    seed: int


@dataclass(frozen=True)
class TrainResult:
    steps: int  # optimizer steps taken in this invocation
    final_step: int
    seconds: float
    loss: float  # mean loss of the last (at most 20) steps; nan if no step was taken
    checkpoint: Path


def add_training_arguments(parser: argparse.ArgumentParser, *, lr: float, batch_size: int, pairs: str) -> None:
    """The data, optimisation and checkpoint options every training CLI shares; a micro-batch holds
    `batch_size` (`pairs`) pairs by default."""
    add_data_arguments(parser)
    group = parser.add_argument_group("optimisation and checkpoints")
    group.add_argument("--batch-size", type=int, default=batch_size, help=f"({pairs}) pairs per micro-batch")
    group.add_argument("--output", type=Path, required=True, help="folder for checkpoint-NNNNNNN/ subfolders")
    group.add_argument("--max-steps", type=int, default=1000, help="optimizer steps in all (default 1000)")
    group.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    group.add_argument("--lr", type=float, default=lr, help=f"peak AdamW learning rate (default {lr:g})")
    group.add_argument(
        "--warmup-steps", type=int, default=None, help="linear warm-up steps (default 10%% of --max-steps)"
    )
    group.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default 0.01)")
    group.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping; 0 turns it off")
    group.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps, and at the end")
    group.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept; 0 keeps all")
    group.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output")
    group.add_argument("--seed", type=int, default=13, help="seed of the batches, negatives and initialisation")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    for name in ("max_steps", "warmup_steps", "keep_checkpoints"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise TrainingDataError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    for name in ("batch_size", "accumulate", "save_every"):
        if getattr(args, name) < 1:
            raise TrainingDataError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        raise TrainingDataError(f"--lr must be > 0, got {args.lr}")
    warmup = args.max_steps // 10 if args.warmup_steps is None else args.warmup_steps
    return TrainSettings(
        output=args.output,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        accumulate=args.accumulate,
        lr=args.lr,
        warmup_steps=warmup,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        save_every=args.save_every,
        keep_checkpoints=args.keep_checkpoints,
        seed=args.seed,
    )


def checkpoints(output: Path) -> list[Path]:
    """Complete checkpoints in `output`, oldest first."""
    if not output.is_dir():
        return []
    found = [p for p in output.glob(f"{CHECKPOINT_PREFIX}*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: json.loads((p / STATE_FILE).read_text())["step"])


def resume_point(output: Path, resume: bool) -> Path | None:
    """The checkpoint to start from, or None to start afresh; refuses to mix a new run into old checkpoints."""
    found = checkpoints(output)
    if found and not resume:
        raise TrainingDataError(f"{output} already holds checkpoints; pass --resume or choose another --output")
    if resume and not found:
        print(f"no checkpoint in {output}; starting from step 0", file=sys.stderr)
    return found[-1] if found else None


def _optimizer(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.AdamW:
    # BERT's convention: no weight decay on biases and LayerNorm weights.
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (no_decay if parameter.ndim < 2 else decay).append(parameter)
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel: on the CPU it updates MiniLM several times faster than the per-tensor loop.
    fused = all(parameter.device.type in ("cpu", "cuda") and parameter.is_floating_point()
                for group in groups for parameter in group["params"])
    return torch.optim.AdamW(groups, lr=settings.lr, fused=fused or None)


def train(
    trainee: Trainee, settings: TrainSettings, start: Path | None = None, about: dict | None = None
) -> TrainResult:
    """Runs optimizer steps up to `settings.max_steps`, from `start` (a checkpoint the trainee was loaded from)."""
    optimizer = _optimizer(trainee.model, settings)
    scheduler = get_linear_schedule_with_warmup(optimizer, settings.warmup_steps, max(settings.max_steps, 1))
    about = dict(about or {})
    step = 0
    if start is not None:
        state = _restore(start, settings, optimizer, scheduler, about)
        step = state["step"]
        about["started_from"] = state.get("started_from")  # the run's origin, not the checkpoint
    first_step = step
    settings.output.mkdir(parents=True, exist_ok=True)
    losses: deque[float] = deque(maxlen=20)
    started = time.perf_counter()
    checkpoint = start
    trainee.model.train()
    # In a log file (no terminal) every redraw is a line of its own: redraw seldom there.
    redraw = 0.1 if sys.stderr.isatty() else 30.0
    with tqdm(total=settings.max_steps, initial=step, desc="training", unit="step", mininterval=redraw) as bar:
        while step < settings.max_steps:
            step_loss = 0.0
            for micro in range(settings.accumulate):
                batch_index = step * settings.accumulate + micro
                torch.manual_seed(settings.seed * 1_000_003 + batch_index)  # dropout, reproducible on resume
                loss = trainee.loss(batch_index) / settings.accumulate
                loss.backward()
                step_loss += loss.item()
            if settings.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(trainee.model.parameters(), settings.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            losses.append(step_loss)
            bar.set_postfix(
                loss=f"{sum(losses) / len(losses):.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", refresh=False
            )
            bar.update(1)
            if step % settings.save_every == 0 or step == settings.max_steps:
                checkpoint = _save(trainee, optimizer, scheduler, settings, step, about)
    if checkpoint is None:  # --max-steps 0 on a fresh run: the starting model as checkpoint 0
        checkpoint = _save(trainee, optimizer, scheduler, settings, step, about)
    seconds = time.perf_counter() - started
    mean_loss = sum(losses) / len(losses) if losses else float("nan")
    return TrainResult(step - first_step, step, seconds, mean_loss, checkpoint)


def _restore(start: Path, settings: TrainSettings, optimizer, scheduler, about: dict) -> dict:
    """Loads optimizer and scheduler state from checkpoint `start`; returns its trainer state. What the
    trainee says of its run (`about`: objective, frozen layers, pairs ...) must match the checkpoint's too."""
    state = json.loads((start / STATE_FILE).read_text())
    recorded = [(name, state["settings"][name], getattr(settings, name)) for name in RESUME_MUST_MATCH]
    recorded += [(name, state[name], value) for name, value in about.items() if name != "started_from" and name in state]
    for name, was, now in recorded:
        if was != now:
            raise TrainingDataError(f"{start}: was trained with {name}={was}, not {now}; resume with the same value")
    saved = torch.load(start / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    return state


def _save(trainee, optimizer, scheduler, settings: TrainSettings, step: int, about: dict) -> Path:
    """Writes checkpoint `step` into a temporary folder, then renames it into place."""
    final = settings.output / f"{CHECKPOINT_PREFIX}{step:07d}"
    temporary = settings.output / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    was_training = trainee.model.training
    trainee.model.eval()
    trainee.save(temporary)
    trainee.model.train(was_training)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, temporary / OPTIMIZER_FILE)
    settings_record = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()}
    state = {"step": step, "settings": settings_record, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **about}
    (temporary / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    if final.exists():  # a rerun from an earlier checkpoint overwrites the later ones it recomputes
        stale = final.with_name(f".{final.name}.stale-{os.getpid()}")
        final.rename(stale)
        os.replace(temporary, final)
        shutil.rmtree(stale)
    else:
        os.replace(temporary, final)
    if settings.keep_checkpoints:
        for old in checkpoints(settings.output)[: -settings.keep_checkpoints]:
            shutil.rmtree(old)
    return final


def summary(kind: str, result: TrainResult) -> str:
    """The one line a CLI prints at the end."""
    loss = f"final loss {result.loss:.4f} (mean of last steps)" if result.steps else "no step taken"
    return (
        f"{kind}: {result.steps} steps (now at step {result.final_step}) in {result.seconds:.1f} s, "
        f"{loss}; model: {result.checkpoint}"
    )


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training data: --triples, or --corpus + --queries + --qrels")
    group.add_argument("--corpus", type=Path, help="passages: TSV pid<TAB>text, or JSONL/BEIR {_id, title, text}")
    group.add_argument("--queries", type=Path, help="queries: TSV qid<TAB>text, or BEIR JSONL {_id, text}")
    group.add_argument("--qrels", type=Path, help="TREC qid 0 pid rel, or BEIR TSV (rel > 0 is relevant)")
    group.add_argument("--triples", type=Path, help="TSV: query<TAB>positive passage<TAB>negative passage")
    group.add_argument("--withhold", type=Path, metavar="FILE",
                       help="passage ids (one a line) never trained on, as positive, negative or in a list: a "
                            "held-out part's relevant passages (training.split --split withheld writes them)")


def add_negatives_arguments(parser: argparse.ArgumentParser, default: int | None, help: str) -> None:
    """`--negatives` (sampled per positive), and `--negatives-run` / `--negatives-depth`, read by `load_training_data`."""
    parser.add_argument("--negatives", type=int, default=default, help=help)
    parser.add_argument("--negatives-run", type=Path, nargs="+", metavar="RUN",
                        help="TREC runs whose top-k (pooled, e.g. dense and BM25) supply the negatives")
    parser.add_argument("--negatives-depth", type=int, default=1000, help="k of each run's top-k (default 1000)")


def load_training_data(args: argparse.Namespace) -> Collection:
    """The collection of `add_data_arguments`, with hard negatives from `--negatives-run` where given."""
    if args.negatives_depth < 1:
        raise TrainingDataError(f"--negatives-depth must be >= 1, got {args.negatives_depth}")
    withheld = frozenset()
    if args.withhold is not None:
        if args.triples is not None:
            raise TrainingDataError("--withhold names corpus passage ids; use it with --corpus/--queries/--qrels")
        withheld = read_withheld(args.withhold)
    data = load_collection(triples=args.triples, corpus=args.corpus, queries=args.queries, qrels=args.qrels,
                           withheld=withheld)
    if args.withhold is not None:
        print(f"withheld from training: the {len(withheld)} passages of {args.withhold}", file=sys.stderr)
    if args.negatives_run:
        if args.triples is not None:
            raise TrainingDataError("--negatives-run names corpus passage ids; use it with --corpus/--queries/--qrels")
        names = " + ".join(str(path) for path in args.negatives_run)
        covered = data.use_run_negatives(pool_runs([read_run(path, args.negatives_depth) for path in args.negatives_run]))
        if not covered:
            raise TrainingDataError(f"{names}: no query of the qrels has an unjudged passage in its top-k")
        print(f"negatives from {names} for {covered} of {len(data.positives)} queries", file=sys.stderr)
    return data


def run_cli(kind, parser: argparse.ArgumentParser, build, argv: list[str] | None = None) -> int:
    """A training CLI's whole body: `build(args, start)` returns (trainee, about); bad input exits 2 with one
    line. `kind` names the model in the summary: a string, or a function of the arguments."""
    args = parser.parse_args(argv)
    kind = kind(args) if callable(kind) else kind
    try:
        settings = settings_from_args(args)
        start = resume_point(settings.output, args.resume)
        trainee, about = build(args, start)
    except (TrainingDataError, OSError, ValueError) as error:  # OSError, ValueError: a model folder refused
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        result = train(trainee, settings, start, about)
    except TrainingDataError as error:  # a resume whose settings would not continue the same run
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(summary(kind, result))
    return 0
