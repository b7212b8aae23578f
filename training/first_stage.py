"""The z-score hybrid's dense weight and pseudo-relevance feedback (retrieval.feedback) chosen on a collection's own
judged queries: each query searched through the Searcher under every setting of a grid, the best setting adopted
only where its gain over the service's defaults is real on those queries (a paired bootstrap interval excluding
zero). bench/first_stage.py cross-validates the choice; training.recipe makes it on its training queries."""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import numpy as np
from tqdm import tqdm

from retrieval.evaluation import paired_bootstrap, per_query
from retrieval.feedback import Feedback
from retrieval.readers import Qrels
from retrieval.request import EVEN_WEIGHT, Defaults
from retrieval.searcher import Searcher

K = 10  # the list nDCG@10 reads
DENSE_WEIGHTS = [round(float(w), 2) for w in np.linspace(0, 1, 21)]
FEEDBACK_PASSAGES = (3, 5, 10)
FEEDBACK_WEIGHTS = (1.0, 2.0, 4.0)


class Setting(NamedTuple):
    dense_weight: float = EVEN_WEIGHT
    feedback: Feedback | None = None

    @property
    def name(self) -> str:
        feedback = self.feedback
        return f"dense weight {self.dense_weight:g}" + (
            "" if feedback is None else f", feedback {feedback.passages} passages x {feedback.weight:g}")

    def env(self) -> dict[str, str]:
        """The service's settings that serve it to requests naming none."""
        passages, weight = (0, 1.0) if self.feedback is None else (self.feedback.passages, self.feedback.weight)
        return {"SEARCH_DEFAULT_DENSE_WEIGHT": f"{self.dense_weight:g}",
                "SEARCH_DEFAULT_FEEDBACK_PASSAGES": str(passages), "SEARCH_DEFAULT_FEEDBACK_WEIGHT": f"{weight:g}"}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Setting":
        """The setting `env` (as Setting.env writes it) serves."""
        passages = int(env["SEARCH_DEFAULT_FEEDBACK_PASSAGES"])
        return cls(float(env["SEARCH_DEFAULT_DENSE_WEIGHT"]),
                   Feedback(passages, float(env["SEARCH_DEFAULT_FEEDBACK_WEIGHT"])) if passages else None)

    def defaults(self) -> Defaults:
        """A Searcher's defaults that run it."""
        return Defaults(dense_weight=self.dense_weight, feedback=self.feedback)


DEFAULT = Setting()  # what the service runs unless told otherwise


def grid(passages: Sequence[int] = FEEDBACK_PASSAGES, weights: Sequence[float] = FEEDBACK_WEIGHTS) -> list[Setting]:
    """Every dense weight without feedback and with each of `passages` (0: none) at each of `weights`; the default
    first, so that it wins ties. ValueError for a feedback out of range."""
    feedbacks = [None] + [Feedback(p, w) for p in passages if p for w in weights]
    settings = [Setting(w, f) for f in feedbacks for w in DENSE_WEIGHTS]
    return [DEFAULT] + [setting for setting in settings if setting != DEFAULT]


def values(searcher: Searcher, qrels: Qrels, queries: Mapping[str, str], settings: Sequence[Setting],
           batch: int = 64) -> dict[Setting, dict[str, float]]:
    """nDCG@10 of each query under each setting (exact search), through the Searcher's own request and rank;
    the queries are encoded once."""
    ids = list(queries)
    texts = [queries[q] for q in ids]
    vectors = np.concatenate([searcher.encode(texts[start:start + batch]) for start in range(0, len(ids), batch)])
    out = {}
    for setting in tqdm(settings, desc="first-stage settings", unit="setting", total=len(settings)):
        request = searcher.request(K, mode="hybrid", fusion="zscore", exact=True, dense_weight=setting.dense_weight,
                                   feedback=setting.feedback or False)
        run = {}
        for start in range(0, len(ids), batch):
            part = slice(start, start + batch)
            hits = searcher.hits(searcher.rank(texts[part], vectors[part], request))
            run.update({q: [(hit.id, hit.score) for hit in found] for q, found in zip(ids[part], hits)})
        out[setting] = per_query(qrels, run)
    return out


def adopted(by_setting: Mapping[Setting, Mapping[str, float]], queries: Sequence[str],
            only_real: bool = True) -> tuple[Setting, str]:
    """The setting adopted on `queries`, and why: the best by mean nDCG@10 where its gain over DEFAULT is real on
    them (else DEFAULT), or in any case where not `only_real`."""
    mean = {setting: np.mean([found[q] for q in queries]) for setting, found in by_setting.items()}
    best = max(by_setting, key=lambda setting: mean[setting])  # the first (the default) among equals
    if best == DEFAULT:
        return DEFAULT, "the default is best"
    if not only_real:
        return best, f"{best.name}: {mean[best] - mean[DEFAULT]:+.4f}"
    gain = paired_bootstrap({q: by_setting[DEFAULT][q] for q in queries}, {q: by_setting[best][q] for q in queries})
    if not gain.low > 0:
        return DEFAULT, f"the default kept: the best, {best.name}, not shown better ({gain})"
    return best, f"{best.name}: {gain}"
