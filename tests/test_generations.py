"""Every answer comes from exactly one index generation: a replica that follows its folder while writers
exchange generations under it names, in each answer's X-Index-Generation and in /ready, the generation
that answered, and that generation's passages are the ones it returns."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from index_builder.build import BuildOptions, build_index
from retrieval import index_writer
from retrieval.index_format import generation_id, read_manifest
from retrieval.searcher import Searcher
from service.engine.search_engine import SearchEngine
from tests.conftest import CPU
from tests.test_admission import serving

TOPICS = ["rivers", "lanterns", "compilers", "meadows", "violins", "glaciers", "parsers", "harbours", "archives"]
PASSAGES = 30
SHIFT = 11  # generation B gives passage i's text to id p{(i + SHIFT) % PASSAGES}


def text(number: int) -> str:
    return f"passage {number} on {TOPICS[number % len(TOPICS)]} and {TOPICS[(number * 4 + 3) % len(TOPICS)]}"


def build_generation(folder: Path, ids: dict[int, str], encoder, reverse: bool = False) -> dict[str, str]:
    """An index of the texts `ids` keys number, each under its id, in a row order of its own (`reverse`);
    the text -> id map a search for a passage's own text must find."""
    numbers = sorted(ids, key=lambda number: (number * 7) % PASSAGES, reverse=reverse)
    corpus = folder.with_suffix(".jsonl")
    corpus.write_text("".join(json.dumps({"id": ids[n], "text": text(n)}) + "\n" for n in numbers), encoding="utf-8")
    build_index(BuildOptions(corpus, folder, chunk_size=16, bm25=False), encoder)
    return {text(n): ids[n] for n in numbers}


@pytest.fixture(scope="module")
def generations(tmp_path_factory, encoder) -> tuple[Path, dict[str, dict[str, str]]]:
    """Two valid generations of one folder: A (30 passages) and B (26 of the texts, their ids shifted)."""
    root = tmp_path_factory.mktemp("generations")
    answers_a = build_generation(root / "a", {n: f"p{n}" for n in range(PASSAGES)}, encoder)
    answers_b = build_generation(root / "b", {n: f"p{(n + SHIFT) % PASSAGES}" for n in range(PASSAGES - 4)},
                                 encoder, reverse=True)
    expected = {generation_id(read_manifest(root / "a")): answers_a, generation_id(read_manifest(root / "b")): answers_b}
    return root, expected


def test_a_loaded_index_answers_from_its_own_generation_on_every_thread_after_another_is_exchanged_in(
        generations, encoder):
    root, expected = generations
    searcher = Searcher(root / "a", encoder, load=CPU)
    answers = expected[searcher.generation]
    query = text(5)
    assert index_writer._exchange(root / "a", root / "b")
    try:
        with ThreadPoolExecutor(1) as other_thread:  # a thread that has not read the index yet
            hits = other_thread.submit(searcher.search, query, 1, exact=True).result()
            filtered = other_thread.submit(searcher.search, query, 3, fields=True).result()
    finally:
        assert index_writer._exchange(root / "a", root / "b")
    assert (hits[0].id, hits[0].text) == (answers[query], query)
    assert [hit.id for hit in filtered] == [answers[hit.text] for hit in filtered]


def test_a_replica_exchanged_between_two_generations_answers_each_search_from_the_one_it_names(
        generations, encoder):
    root, expected = generations
    served, other = root / "a", root / "b"
    texts = [t for t in expected[generation_id(read_manifest(other))]]  # in both generations
    engine = SearchEngine(Searcher(served, encoder, load=CPU))
    answers: list[tuple] = []
    stop = threading.Event()

    def client(seed: int) -> None:
        draw = random.Random(seed)
        with httpx.Client(base_url=base, trust_env=False, timeout=60) as http:
            while not stop.is_set():
                query = draw.choice(texts)
                response = http.post("/search", json={"query": query, "k": 1, "exact": True})
                top = response.json()["results"][0] if response.status_code == 200 else None
                answers.append((response.status_code, response.headers.get("x-index-generation"), query, top))

    exchanges = 0
    with serving(served, engine, watch_index=True, watch_interval_s=0.05) as (_, base, _port):
        threads = [threading.Thread(target=client, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        draw = random.Random(7)
        try:
            deadline = time.monotonic() + 120
            while (len(answers) < 300 or exchanges < 8) and time.monotonic() < deadline:
                time.sleep(draw.uniform(0.2, 1.0) if exchanges % 4 else draw.uniform(1.0, 3.0))
                assert index_writer._exchange(served, other)  # what move_into_place does, in one step
                exchanges += 1
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
        ready = httpx.get(f"{base}/ready", trust_env=False).json()
        assert ready["index"]["generation"] in expected

    failed = [answer for answer in answers if answer[0] != 200]
    wrong = [answer for answer in answers if answer[0] == 200 and (
        answer[1] not in expected or answer[3]["id"] != expected[answer[1]][answer[2]] or answer[3]["text"] != answer[2])]
    assert not failed and not wrong, (len(failed), len(wrong), (failed + wrong)[:3])
    seen = {answer[1] for answer in answers}
    assert len(answers) >= 300 and exchanges >= 8 and seen == set(expected), (len(answers), exchanges, seen)


def test_ready_names_the_generation_served_and_each_answer_carries_it(generations, encoder):
    root, expected = generations
    engine = SearchEngine(Searcher(root / "a", encoder, load=CPU))
    with serving(root / "a", engine) as (_, base, _port):
        ready = httpx.get(f"{base}/ready", trust_env=False).json()
        answer = httpx.post(f"{base}/search", json={"query": text(3), "k": 2}, trust_env=False)
        batch = httpx.post(f"{base}/search/batch", json={"queries": [text(3)], "k": 2}, trust_env=False)
    name = generation_id(read_manifest(root / "a"))
    assert ready["index"]["generation"] == name == answer.headers["x-index-generation"]
    assert batch.headers["x-index-generation"] == name and len(name) == 16
