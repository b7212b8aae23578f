"""All three kinds of reranker, as their training CLIs save them, served side by side and chosen
per request through /search, each timed in latency_ms.rerank and in /stats and /metrics."""

from __future__ import annotations

import pytest

from service.settings import ServiceSettings
from tests.test_coattention import TINY_CLI
from tests.test_cross_encoder import tiny_bert
from tests.test_training import demo_split, serving  # noqa: F401 - demo_split is a fixture
from training.train_coattention import main as train_coattention
from training.train_generative import main as train_generative

KINDS = ("monobert", "coattention", "generative")


@pytest.fixture(scope="module")
def reranker_folders(tmp_path_factory, demo_split) -> list:  # noqa: F811
    folder = tmp_path_factory.mktemp("rerankers")
    steps = ["--batch-size", "2", "--max-steps", "2", "--save-every", "2"]
    assert train_coattention([*demo_split["train"], *TINY_CLI, *steps, "--max-vocab", "3000",
                              "--output", str(folder / "coattention")]) == 0
    assert train_generative(["--objective", "mle", "--scratch", "causal", "--vocab-size", "500", "--layers", "1",
                             "--width", "32", "--heads", "2", "--query-max-tokens", "16", "--passage-max-tokens", "64",
                             *demo_split["train"], *steps, "--output", str(folder / "generative")]) == 0
    return [tiny_bert(folder / "monobert"), folder / "coattention" / "checkpoint-0000002",
            folder / "generative" / "checkpoint-0000002"]


def test_each_reranker_serves_through_search_with_its_own_timing(small_index, reranker_folders):
    settings = ServiceSettings(index_dir=small_index, device="cpu", rerankers=reranker_folders, rerank_depth=10)
    with serving(settings) as client:
        assert list(client.get("/ready").json()["index"]["rerankers"]) == list(KINDS)
        default = client.post("/search", json={"query": "join two paths", "k": 5, "rerank": True}).json()
        for kind in KINDS:
            response = client.post("/search", json={"query": "join two paths", "k": 5, "rerank": True, "reranker": kind})
            assert response.status_code == 200, response.text
            body = response.json()
            scores = [r["score"] for r in body["results"]]
            assert len(scores) == 5 and scores == sorted(scores, reverse=True)
            assert body["latency_ms"]["rerank"] > 0
            if kind == "monobert":  # the first configured is the default
                assert [r["id"] for r in body["results"]] == [r["id"] for r in default["results"]]
        stats = client.get("/stats").json()
        assert set(stats["rerank_ms"]) == set(KINDS) and all(v["p50"] > 0 for v in stats["rerank_ms"].values())
        metrics = client.get("/metrics").text
        for kind in KINDS:
            assert f'search_rerank_seconds_count{{reranker="{kind}"}}' in metrics
