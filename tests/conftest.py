"""Shared fixtures: one real MiniLM encoder and one small real index per test session."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from index_builder.build import BuildOptions, build_index
from index_builder.merge import merge_shards
from models.encoder import BiEncoder
from retrieval.load_options import LoadOptions
from retrieval.searcher import Searcher
from retrieval.sharding import shard_folder
from service.engine.search_engine import SearchEngine

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"
CRANFIELD = ROOT.parent / "shared" / "data" / "cranfield"
# The demo corpus keeps the relevant passages of q0001..q0100 within its first 300 lines.
SMALL_CORPUS_LINES = 300
SMALL_SHARDS = 3
CPU = LoadOptions(device="cpu")  # how the tests load an index

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def killed_after_chunks(arguments: list[str], state: Path, chunks: int) -> int:
    """`python -m index_builder ARGUMENTS...` killed with SIGKILL once its build's `state` file records `chunks`
    committed chunks (so while it encodes); the chunks it had committed when it died."""
    process = subprocess.Popen([sys.executable, "-m", "index_builder", *arguments], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if state.is_file() and len(json.loads(state.read_text())["chunks"]) >= chunks:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    process.wait()
    assert process.returncode == -signal.SIGKILL, f"{arguments[0]} finished before it could be killed"
    return len(json.loads(state.read_text())["chunks"])


def head(path: Path, lines: int) -> str:
    with path.open(encoding="utf-8") as handle:
        return "".join(next(handle) for _ in range(lines))


def demo_corpus_head(folder: Path, lines: int) -> Path:
    """A corpus file in `folder` holding the demo corpus's first `lines` lines."""
    path = folder / "corpus.tsv"
    path.write_text(head(DEMO / "corpus.tsv", lines), encoding="utf-8")
    return path


def read_tsv(path: Path) -> dict[str, str]:
    return dict(line.rstrip("\n").split("\t", 1) for line in path.open(encoding="utf-8") if line.strip())


def read_qrels_map(path: Path) -> dict[str, str]:
    """query id -> its one relevant passage id (the demo collection judges one passage per query)."""
    return {fields[0]: fields[2] for fields in (line.split() for line in path.open()) if fields}


@pytest.fixture(scope="session")
def encoder() -> BiEncoder:
    return BiEncoder(device="cpu")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    return demo_corpus_head(tmp_path_factory.mktemp("corpus"), SMALL_CORPUS_LINES)


@pytest.fixture(scope="session")
def small_index(tmp_path_factory, small_corpus, encoder) -> Path:
    out = tmp_path_factory.mktemp("indexes") / "small"
    build_index(BuildOptions(small_corpus, out, chunk_size=128, bm25=True), encoder)
    return out


@pytest.fixture(scope="session")
def small_shards(tmp_path_factory, small_corpus, encoder) -> list[Path]:
    """The small corpus as `build --shards 3` writes it (in one pass): the shards of `small_index`'s passages.
    (tests/test_shards.py shows they equal what three `build --shard i/3` jobs write.)"""
    out = tmp_path_factory.mktemp("shards") / "small"
    build_index(BuildOptions(small_corpus, out, chunk_size=128, shards=SMALL_SHARDS, bm25=False), encoder)
    return [shard_folder(out, i) for i in range(SMALL_SHARDS)]


@pytest.fixture(scope="session")
def merged_shards(tmp_path_factory, small_shards) -> Path:
    """`small_shards` merged (index_builder merge): one flat index over the very vectors the shards hold.
    (An unsharded build encodes the passages in other batches, so its vectors differ in the last bits.)"""
    out = tmp_path_factory.mktemp("merged") / "merged"
    merge_shards(small_shards, out, bm25=False)  # dense only, as the shards serve
    return out


@pytest.fixture(scope="session")
def searcher(small_index, encoder) -> Searcher:
    return Searcher(small_index, encoder, load=CPU)


@pytest.fixture(scope="session")
def engine(searcher) -> SearchEngine:
    return SearchEngine(searcher)


@pytest.fixture(scope="session")
def demo_queries() -> dict[str, str]:
    return read_tsv(DEMO / "queries.tsv")


@pytest.fixture(scope="session")
def demo_qrels() -> dict[str, str]:
    return read_qrels_map(DEMO / "qrels.txt")


# SEARCH_READ_TIMEOUT_S and SEARCH_WRITE_TIMEOUT_S of the session's Ray Serve: what HAProxy in front of it
# allows a client that sends or reads nothing (short, so that tests/test_sharded_serving.py can see it).
RAY_CLIENT_TIMEOUT_S = 3


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (the Ray build and sharded serving share it): 2 CPUs,
    and workers that import this checkout's code, whatever the environment has installed."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'dense-search[ray]')")
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'dense-search[ray]')")
    from service.settings import ServiceSettings
    from service.sharded.placement import job_env  # Serve's settings as `python -m service --ray` starts it (HAProxy, gRPC)

    env = job_env(ServiceSettings(read_timeout_s=RAY_CLIENT_TIMEOUT_S, write_timeout_s=RAY_CLIENT_TIMEOUT_S), local=True)
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, runtime_env={"env_vars": env})
    yield ray
    ray.shutdown()
