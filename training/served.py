"""A pipeline's answers as the service gives them: the service's own engine (`SearchEngine.served`) under the
settings that serve the pipeline (the `SEARCH_*` variables of its serve.env, read into `ServiceSettings` as
`python -m service` reads them), each query sent as a `/search` request is (`service.http.routes.search.answer`).
The recipe reports what it measures this way, so its figures are the service's, not those of a copy of it."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from tqdm import tqdm

from retrieval.readers import Run
from retrieval.searcher import Hit
from service.engine.search_engine import SearchEngine
from service.http.routes.search import answer
from service.http.schemas import SearchRequest
from service.settings import ServiceSettings

ANSWER_K = 100  # the k each held-out query asks the service for: deeper than any rerank depth, as users ask


@contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` set over the process's environment, as `set -a; . serve.env` sets them over the shell's."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def served_settings(env: Mapping[str, str], device: str) -> ServiceSettings:
    """The settings `python -m service` runs under with `env` set (and SEARCH_DEVICE `device`)."""
    with _environment({**env, "SEARCH_DEVICE": device}):
        return ServiceSettings()


def served_answers(env: Mapping[str, str], device: str, queries: Mapping[str, str], k: int, rerank: bool,
                   label: str) -> dict[str, list[Hit]]:
    """Each query's answer to `{"query": ..., "k": k, "rerank": rerank}` from the service started with `env`;
    ValueError naming the query for one the service refuses."""
    settings = served_settings(env, device)
    engine = SearchEngine.served(settings)
    answers = {}
    for qid, text in tqdm(queries.items(), desc=label, unit=" queries"):
        try:
            request = SearchRequest.model_validate({"query": text, "k": k, "rerank": rerank})
            answers[qid] = answer(settings, engine, request).hits
        except ValueError as error:
            raise ValueError(f"query {qid}: the service refuses it ({error})") from None
    return answers


def ranked_run(answers: Mapping[str, list[Hit]]) -> Run:
    """The answers as a run whose scores keep the served order (a reranked head's scores and the retrieval
    scores of the passages after it are on different scales, so sorting by them would reorder the list)."""
    return {qid: [(hit.id, float(-hit.rank)) for hit in hits] for qid, hits in answers.items()}


def write_answers(path: Path, answers: Mapping[str, list[Hit]]) -> None:
    """One line a query: {"query": its id, "results": [{"id", "score", "rank"}, ...]}, as the service answered."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for qid, hits in answers.items():
            results = [{"id": hit.id, "score": hit.score, "rank": hit.rank} for hit in hits]
            out.write(json.dumps({"query": qid, "results": results}) + "\n")


def read_answers(path: Path) -> dict[str, list[dict]]:
    """`write_answers`' file: each query's results."""
    with path.open() as lines:
        return {record["query"]: record["results"] for record in map(json.loads, lines)}
