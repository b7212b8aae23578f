"""What the judged recipe (training.recipe) and the unjudged one (training.unjudged) share: the pipeline a recipe
serves and its environment file, the folder's settings a rerun must match, the index builds and the bi-encoder's
training flags."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

MEASURE = "nDCG@10"
K = 10  # the list the measure reads

SETTINGS_FILE = "recipe-settings.json"

DEFAULT, TUNED, BIENCODER = "default", "tuned", "biencoder"
# The first stages a pipeline starts from: the index's own default retrieval, the same with its dense weight and
# feedback tuned on the training queries, and the default retrieval over an index of the corpus encoded by the
# bi-encoder fine-tuned on the training queries (--biencoder-steps).
FIRST_STAGES = {DEFAULT: "default retrieval", TUNED: "tuned default retrieval",
                BIENCODER: "fine-tuned bi-encoder's retrieval"}


class RecipeError(ValueError):
    """Bad input or a step that failed: the CLI's exit 2."""


@dataclass(frozen=True)
class Pipeline:
    """The default retrieval, then (with a checkpoint) its top `depth` reranked on `backend`, ordered by
    z(reranker) + `weight` x z(first stage) (retrieval.rerank.rescored; 0: the reranker's score alone)."""

    checkpoint: Path | None = None
    backend: str = "torch"
    depth: int = 0
    weight: float = 0.0
    first_stage: str = DEFAULT  # FIRST_STAGES: whose index's default retrieval it reranks
    untrained: bool = False  # the checkpoint is --init-reranker's, not trained on this collection

    @property
    def name(self) -> str:
        if self.checkpoint is None:
            return FIRST_STAGES[self.first_stage]
        on = "" if self.first_stage == DEFAULT else f"{FIRST_STAGES[self.first_stage]} + "
        checkpoint = f"untrained {self.checkpoint}" if self.untrained else self.checkpoint.name
        return f"{on}{checkpoint} {self.backend} depth {self.depth} weight {self.weight:g}"

    def settings(self, indexes: Mapping[str, Path], tuned: Mapping[str, str] | None = None) -> dict[str, str]:
        """The service's environment that serves this pipeline (requests ask `"rerank": true`); `indexes`: each
        first stage's index; `tuned`: the settings of the tuned first stage (training.first_stage.Setting.env)."""
        index = indexes[self.first_stage]
        stage = dict(tuned or {}) if self.first_stage == TUNED else {}
        if self.checkpoint is None:
            return {"SEARCH_INDEX_DIR": str(index.resolve()), "SEARCH_RERANKERS": "[]", **stage}
        return {"SEARCH_INDEX_DIR": str(index.resolve()), **stage,
                "SEARCH_RERANKERS": json.dumps([str(self.checkpoint.resolve())]),
                "SEARCH_RERANK_DEPTH": str(self.depth), "SEARCH_RERANK_RETRIEVAL_WEIGHT": f"{self.weight:g}",
                "SEARCH_RERANK_BACKEND": self.backend}

    def as_json(self) -> dict:
        return {"checkpoint": str(self.checkpoint) if self.checkpoint else None, "backend": self.backend,
                "depth": self.depth, "weight": self.weight, "first_stage": self.first_stage,
                "untrained": self.untrained}


def check_settings(out: Path, settings: dict) -> None:
    """A rerun in DIR must ask what DIR was made for: its model resumes on DIR's split."""
    file = out / SETTINGS_FILE
    if file.is_file():
        saved = json.loads(file.read_text())
        changed = sorted(key for key in settings.keys() | saved.keys() if settings.get(key) != saved.get(key))
        if changed:
            raise RecipeError(f"{out} was made with other {', '.join(changed)} ({file}): give another --out")
    out.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(settings, indent=1) + "\n")


def env_file(path: Path, pipeline: Pipeline, indexes: Mapping[str, Path], tuned: Mapping[str, str], about: str) -> None:
    lines = [f"# {about}", f"# serve: set -a; . {path}; set +a; python -m service (requests ask \"rerank\": true)"]
    lines += [f"{name}='{value}'" for name, value in pipeline.settings(indexes, tuned).items()]
    path.write_text("\n".join(lines) + "\n")


def write_json(path: Path, value: dict) -> None:
    """`value` into `path` whole or not at all: a fold's summary tells a rerun the fold finished."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(value, indent=1) + "\n")
    part.replace(path)


def build_index(corpus: Path, index: Path, device: str, model: Path | None = None, bm25: bool = True) -> None:
    """An index of `corpus` (with BM25 unless not `bm25`) in `index`, encoded by `model` (None: the packaged
    MiniLM), kept where one is there already."""
    encoder = [] if model is None else ["--model", str(model)]
    built = subprocess.run([sys.executable, "-m", "index_builder", "build", "--corpus", str(corpus),
                            "--out", str(index), "--if-missing", "--device", device, *encoder,
                            *([] if bm25 else ["--no-bm25"])]).returncode
    if built:
        raise RecipeError(f"building the index of {corpus} into {index} failed (exit {built})")


# How the recipe fine-tunes the bi-encoder (scripts/scifact.sh's `biencoder`): one hard negative a pair from the
# negatives run's top 100 beside the batch's, softmax, batch 16, lr 2e-5.
BIENCODER_TRAINING = ["--negatives-depth", "100", "--negatives", "1", "--objective", "softmax", "--batch-size", "16",
                      "--lr", "2e-5"]
