"""The residual monoBERT as both recipes train it and read it: a part of the queries with each first stage's
lists (`Part`), the monoBERT trained on one first stage's lists of a part (`train_reranker`), a reranker's
scores of each list's head (`reranker_scores`) and each checkpoint's reranked lists read (`reranked_values`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from tqdm import tqdm

from models.reranker import Reranker, load_reranker
from retrieval.evaluation import as_run, per_query
from retrieval.readers import Qrels, write_run
from retrieval.rerank import reranked_list
from retrieval.searcher import Hit
from training import train_cross_encoder
from training.pipeline import MEASURE, K, Pipeline, RecipeError
from training.trainer import checkpoints

PRIOR_WEIGHT = 0.5  # the first stage's weight in the residual training (scripts/scifact.sh's)


@dataclass
class Part:
    """One part of the queries: their texts, their judgements (or pairs) and each query's list by each first
    stage."""

    queries: dict[str, str]
    qrels: Qrels
    lists: dict[str, dict[str, list[Hit]]]  # first stage -> query -> its list

    def scored(self, pipeline: Pipeline, scores: Mapping[str, Sequence[float]] | None) -> dict[str, float]:
        """Each query's nDCG@10 under `pipeline`; `scores`: its reranker's scores of each list's head."""
        lists = self.lists[pipeline.first_stage]
        if pipeline.checkpoint is None:
            run = as_run({qid: hits[:K] for qid, hits in lists.items()})
        else:
            run = {qid: reranked_list(hits, scores[qid][:pipeline.depth], K, pipeline.weight)
                   for qid, hits in lists.items()}
        return per_query(self.qrels, run, MEASURE)


def reranker_scores(reranker: Reranker, part: Part, stage: str, depth: int, label: str) -> dict[str, list[float]]:
    """`reranker`'s score of the top `depth` of each of `stage`'s lists (one pass serves every smaller depth)."""
    return {qid: [float(s) for s in reranker.score(part.queries[qid], [hit.text for hit in hits[:depth]])]
            for qid, hits in tqdm(part.lists[stage].items(), desc=label, unit=" queries")}


def reranked_values(part: Part, stage: str, saved: Sequence[Path], depths: Sequence[int], weights: Sequence[float],
                    device: str, label: str) -> list[tuple[Pipeline, dict[str, float]]]:
    """Each checkpoint in `saved` at each depth and weight over `stage`'s lists of `part` (torch), in that order,
    with each query's nDCG@10 under it."""
    rows = []
    for checkpoint in saved:
        scores = reranker_scores(load_reranker(checkpoint, device=device, backend="torch"), part, stage, max(depths),
                                 f"{label}, {checkpoint.name}")
        rows += [(pipeline, part.scored(pipeline, scores)) for pipeline in
                 (Pipeline(checkpoint, "torch", depth, weight, stage) for depth in depths for weight in weights)]
    return rows


def train_reranker(corpus: Path, queries: Path, qrels: Path, lists: Mapping[str, list[Hit]], out: Path, *, tag: str,
                   steps: int, save_every: int, max_tokens: int, seed: int, device: str, init: Path | None = None,
                   withhold: Sequence[str] = ()) -> list[Path]:
    """The residual monoBERT trained (or its interrupted training resumed) into OUT/model on the queries' `lists`
    by one first stage (written to OUT/runs/train.run, tagged `tag`), from `init` where given (default: the
    packaged MiniLM); its checkpoints."""
    (out / "runs").mkdir(parents=True, exist_ok=True)
    prior = out / "runs" / "train.run"
    write_run(prior, as_run(lists), tag=tag)
    model = out / "model"
    trained = train_cross_encoder.main([
        "--corpus", str(corpus), "--queries", str(queries), "--qrels", str(qrels), "--objective", "residual",
        "--prior-run", str(prior), "--prior-weight", str(PRIOR_WEIGHT), "--negatives", "3", "--batch-size", "4",
        "--lr", "3e-5", "--max-steps", str(steps), "--max-tokens", str(max_tokens), "--save-every", str(save_every),
        "--keep-checkpoints", "0", "--seed", str(seed), "--device", device, "--resume",
        *(["--init", str(init)] if init else []), *withhold, "--output", str(model)])
    if trained:
        raise RecipeError(f"training the reranker into {model} failed (exit {trained})")
    return checkpoints(model)
