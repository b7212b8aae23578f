"""Training data for every trainer, read from plain files.

Inputs are either qrels + queries + corpus files (read by `retrieval.readers`: TSV, TREC, BEIR),
or a triples TSV (`query<TAB>positive<TAB>negative`, MS MARCO's "Train Triples" layout). Both
become one `Collection`: texts by id, the relevant passages of each query, and optionally a pool
of hard negatives per query (from a triples file or a TREC run).

Batches are a pure function of (seed, batch index), so a resumed run sees exactly the batches an
uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from retrieval.fusion import standardised
from retrieval.readers import Run, lines, read_passages, read_qrels, read_queries, relevant


class TrainingDataError(ValueError):
    """Training data or settings that cannot be used; the CLIs exit 2 with this one-line message."""


def read_triples(path: Path) -> list[tuple[str, str, str]]:
    """A triples TSV, `query<TAB>positive passage<TAB>negative passage`."""
    triples = []
    for number, line in lines(path):
        fields = [text.strip() for text in line.split("\t")]
        if len(fields) != 3 or not all(fields):
            raise TrainingDataError(f"{path}: line {number}: expected 'query<TAB>positive<TAB>negative'")
        triples.append((fields[0], fields[1], fields[2]))
    if not triples:
        raise TrainingDataError(f"{path}: no lines")
    return triples


@dataclass
class Collection:
    """What both trainers sample from. `pairs` lists every (query id, relevant passage id) once."""

    queries: dict[str, str]
    passages: dict[str, str]
    positives: dict[str, set[str]]
    pairs: list[tuple[str, str]]
    negatives: dict[str, list[str]] = field(default_factory=dict)  # hard negatives; absent = sample at random
    teacher: Run = field(default_factory=dict)  # a teacher reranker's scored list per query (distillation)
    prior: Run = field(default_factory=dict)  # a first stage's list per query, z-scores over it (residual)
    _passage_ids: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.pairs:
            raise TrainingDataError("no (query, relevant passage) pair to train on")
        self._passage_ids = list(self.passages)

    def use_run_negatives(self, run: Run) -> int:
        """Take each query's negatives from a run's top-k minus its judged positives (paper 000 section
        4.4.3: train the reranker on the retriever it will rerank). Returns how many queries got a pool."""
        covered = 0
        for qid in self.positives:
            pool = [pid for pid, _ in run.get(qid, []) if pid not in self.positives[qid] and pid in self.passages]
            if pool:
                self.negatives[qid] = pool
                covered += 1
        return covered

    def use_teacher(self, run: Run) -> int:
        """A teacher reranker's run (its passages of each query, with its scores) to distil; returns how many
        training queries it covers. A judged positive missing from a query's list joins it at the list's best
        teacher score: judged relevant, it is at least as good as what the teacher put first."""
        covered = 0
        for qid, positives in self.positives.items():
            scored = [(pid, score) for pid, score in run.get(qid, []) if pid in self.passages]
            if not scored:
                continue
            best = max(score for _, score in scored)
            listed = {pid for pid, _ in scored}
            self.teacher[qid] = scored + [(pid, best) for pid in sorted(positives) if pid not in listed]
            covered += 1
        return covered

    def use_prior(self, run: Run) -> int:
        """The first stage the reranker will be blended with (its passages of each query, with its scores), for
        the residual objective; returns how many training queries it covers. Scores become z-scores over each
        list, as a blend standardises them; a judged positive missing from a list joins it at the list's
        lowest, where the first stage would leave it. A list with no unjudged passage teaches nothing."""
        covered = 0
        for qid, positives in self.positives.items():
            scored = [(pid, score) for pid, score in run.get(qid, []) if pid in self.passages]
            if not any(pid not in positives for pid, _ in scored):
                continue
            z = standardised(np.array([score for _, score in scored], dtype=np.float64)).tolist()
            listed = {pid for pid, _ in scored}
            self.prior[qid] = [(pid, value) for (pid, _), value in zip(scored, z)] + \
                [(pid, min(z)) for pid in sorted(positives) if pid not in listed]
            covered += 1
        return covered

    def sample_negatives(self, qid: str, count: int, rng: np.random.Generator) -> list[str]:
        """`count` passages not judged relevant to `qid`: from its hard-negative pool, else the whole corpus."""
        pool = self.negatives.get(qid)
        if pool:
            return [pool[i] for i in rng.choice(len(pool), size=count, replace=len(pool) < count)]
        positives = self.positives.get(qid, set())
        if len(self._passage_ids) <= len(positives):
            raise TrainingDataError(f"query {qid}: every passage of the corpus is relevant; no negative to sample")
        sampled: list[str] = []
        while len(sampled) < count:
            pid = self._passage_ids[int(rng.integers(len(self._passage_ids)))]
            if pid not in positives:
                sampled.append(pid)
        return sampled


def pool_runs(runs: list[Run]) -> Run:
    """One run whose list for a query is the union of the runs' lists (first appearance kept)."""
    pooled: dict[str, dict[str, float]] = {}
    for run in runs:
        for qid, ranked in run.items():
            for pid, score in ranked:
                pooled.setdefault(qid, {}).setdefault(pid, score)
    return {qid: list(hits.items()) for qid, hits in pooled.items()}


def load_judged(corpus: Path, queries: Path, qrels: Path, withheld: frozenset[str] = frozenset()) -> Collection:
    """Qrels + queries + corpus less the `withheld` passages (so no pair, negative or list holds one).
    Judgements naming a query or passage absent from the files are skipped."""
    passages = {pid: text for pid, text in read_passages(corpus).items() if pid not in withheld}
    query_texts = read_queries(queries)
    judged = relevant(read_qrels(qrels))
    if not judged:
        raise TrainingDataError(f"{qrels}: no relevant judgement (relevance > 0)")
    positives = {
        qid: {pid for pid in pids if pid in passages}
        for qid, pids in judged.items()
        if qid in query_texts
    }
    positives = {qid: pids for qid, pids in positives.items() if pids}
    pairs = [(qid, pid) for qid in positives for pid in sorted(positives[qid])]
    if not pairs:
        raise TrainingDataError(f"{qrels}: no judgement names a query of {queries} and a passage of {corpus}")
    return Collection(query_texts, passages, positives, pairs)


def load_triples(path: Path) -> Collection:
    """A triples TSV; texts get ids by first appearance, so a passage repeated across triples is one passage."""
    queries: dict[str, str] = {}
    passages: dict[str, str] = {}
    query_ids: dict[str, str] = {}
    passage_ids: dict[str, str] = {}

    def passage_id(text: str) -> str:
        if text not in passage_ids:
            passage_ids[text] = f"p{len(passage_ids)}"
            passages[passage_ids[text]] = text
        return passage_ids[text]

    positives: dict[str, set[str]] = {}
    negatives: dict[str, list[str]] = {}
    for query, positive, negative in read_triples(path):
        if query not in query_ids:
            query_ids[query] = f"q{len(query_ids)}"
            queries[query_ids[query]] = query
        qid = query_ids[query]
        positives.setdefault(qid, set()).add(passage_id(positive))
        negatives.setdefault(qid, []).append(passage_id(negative))
    # A passage given as both positive and negative for one query is treated as relevant.
    negatives = {
        qid: [pid for pid in dict.fromkeys(pool) if pid not in positives[qid]] for qid, pool in negatives.items()
    }
    pairs = [(qid, pid) for qid in positives for pid in sorted(positives[qid])]
    return Collection(queries, passages, positives, pairs, {qid: pool for qid, pool in negatives.items() if pool})


def load_collection(
    *, triples: Path | None, corpus: Path | None, queries: Path | None, qrels: Path | None,
    withheld: frozenset[str] = frozenset()
) -> Collection:
    """Exactly one of: `triples`, or all of `corpus`, `queries` and `qrels` (less the `withheld` passages)."""
    judged = (corpus, queries, qrels)
    if triples is not None:
        if any(judged):
            raise TrainingDataError("give either --triples or --corpus/--queries/--qrels, not both")
        return load_triples(triples)
    if not all(judged):
        raise TrainingDataError("training data: give --triples, or all three of --corpus, --queries and --qrels")
    return load_judged(corpus, queries, qrels, withheld)


@lru_cache(maxsize=4)
def _epoch_order(count: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(count)


def batch_positions(count: int, batch_size: int, batch_index: int, seed: int) -> list[int]:
    """Item positions of micro-batch `batch_index`: consecutive slices of one shuffle per epoch.

    Depends only on its arguments, so resuming at any batch reproduces the uninterrupted order.
    """
    positions = []
    for flat in range(batch_index * batch_size, (batch_index + 1) * batch_size):
        epoch, offset = divmod(flat, count)
        positions.append(int(_epoch_order(count, seed, epoch)[offset]))
    return positions


def batch_rng(seed: int, batch_index: int) -> np.random.Generator:
    """The random source of one micro-batch (negative sampling), reproducible on resume."""
    return np.random.default_rng([seed, batch_index, 1])


def sampled_groups(data: Collection, batch_index: int, batch_size: int, negatives: int,
                   seed: int) -> list[tuple[str, list[str]]]:
    """Micro-batch `batch_index` as (query text, [relevant passage text, `negatives` sampled negative
    texts]) groups, one per (query, relevant passage) pair of the batch; reproducible on resume."""
    rng = batch_rng(seed, batch_index)
    groups = []
    for position in batch_positions(len(data.pairs), batch_size, batch_index, seed):
        qid, pid = data.pairs[position]
        sampled = data.sample_negatives(qid, negatives, rng) if negatives else []
        groups.append((data.queries[qid], [data.passages[p] for p in [pid, *sampled]]))
    return groups


def teacher_groups(data: Collection, batch_index: int, batch_size: int,
                   seed: int) -> list[tuple[str, list[str], list[float]]]:
    """Micro-batch `batch_index` for distillation: (query text, passage texts, teacher scores), one per
    query the teacher covers, drawn in the order of `batch_size` queries a batch (reproducible on resume)."""
    qids = sorted(data.teacher)
    groups = []
    for position in batch_positions(len(qids), batch_size, batch_index, seed):
        scored = data.teacher[qids[position]]
        groups.append((data.queries[qids[position]], [data.passages[pid] for pid, _ in scored],
                       [score for _, score in scored]))
    return groups


def prior_groups(data: Collection, batch_index: int, batch_size: int, negatives: int,
                 seed: int) -> list[tuple[str, list[str], list[float]]]:
    """Micro-batch `batch_index` for the residual objective: (query text, [one of its judged positives,
    `negatives` others of its first-stage list], their first-stage z-scores), one per query the first stage
    covers, `batch_size` queries a batch; reproducible on resume."""
    rng = batch_rng(seed, batch_index)
    qids = sorted(data.prior)
    groups = []
    for position in batch_positions(len(qids), batch_size, batch_index, seed):
        qid = qids[position]
        listed = data.prior[qid]
        positives = [i for i, (pid, _) in enumerate(listed) if pid in data.positives[qid]]
        others = [i for i, (pid, _) in enumerate(listed) if pid not in data.positives[qid]]
        chosen = [positives[int(rng.integers(len(positives)))],
                  *(others[i] for i in rng.choice(len(others), size=negatives, replace=len(others) < negatives))]
        groups.append((data.queries[qid], [data.passages[listed[i][0]] for i in chosen], [listed[i][1] for i in chosen]))
    return groups
