"""The architecture as a specification: which folder may import which, one way to save and load
every model, one meaning of a device string, and indexes built before the layout change still served."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import get_args

import numpy as np
import pytest
import torch

from index_builder.build import BuildOptions, build_index
from models.checkpoint import resolve_device
from models.coattention import CoAttentionConfig, CoAttentionReranker, Vocabulary
from models.cross_encoder import CrossEncoder
from models.encoder import BiEncoder
from models.generative import new_small_model
from models.reranker import RERANKERS, load_reranker
from retrieval.candidates.registry import KINDS
from retrieval.index_format import read_manifest
from retrieval.searcher import Searcher
from service.http import schemas
from tests.conftest import CPU, DEMO, ROOT, head, read_tsv
from tests.test_cross_encoder import tiny_bert

PACKAGES = ("models", "retrieval", "index_builder", "service", "training")
# What each folder must never import: data flows corpus -> index_builder -> index -> service, through
# retrieval; models sit below everything; training sits beside (measuring a pipeline through the service's own
# engine, training/served.py), and serving never imports it.
FORBIDDEN = {
    "models": {"retrieval", "index_builder", "service", "training", "faiss", "fastapi", "starlette", "uvicorn"},
    "retrieval": {"index_builder", "service", "training", "fastapi", "starlette", "uvicorn"},
    "index_builder": {"service", "training", "fastapi"},
    "service": {"index_builder", "training"},
    "training": {"index_builder", "faiss", "fastapi"},
}
BEFORE_LAYOUT = ROOT / "tests" / "data" / "index-before-layout"  # built by the code before this layout


def imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_no_folder_imports_against_the_direction_of_the_data(package):
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & FORBIDDEN[package])
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def code_naming(name: str, *, besides: Path) -> list[str]:
    """The code files outside `besides` (a folder or a module) that hold `name` as a string literal."""
    literal = re.compile(rf"[\"']{re.escape(name)}[\"']")
    return sorted(str(path.relative_to(ROOT)) for package in PACKAGES if package != "training"
                  for path in (ROOT / package).rglob("*.py")
                  if not path.is_relative_to(besides) and literal.search(path.read_text()))


def test_a_candidate_kind_is_its_module_and_its_line_in_the_registry():
    folder = ROOT / "retrieval" / "candidates"
    shared = {"__init__", "kind", "registry", "structures", "recall"}
    assert {path.stem for path in folder.glob("*.py")} - shared == set(KINDS)
    for name, kind in KINDS.items():
        assert type(kind).__module__ == f"retrieval.candidates.{name}"
        assert code_naming(name, besides=folder) == [], name  # the manifest, `ann` and the service ask the registry


def test_a_reranker_kind_is_its_class_and_its_line_in_the_registry():
    for name, kind in RERANKERS.items():
        assert code_naming(name, besides=Path(sys.modules[kind.__module__].__file__)) == [], name
    # and the HTTP API names it, with its score's kind and meaning
    assert get_args(schemas.RerankerKind) == tuple(RERANKERS)
    for name, kind in RERANKERS.items():
        assert kind.score_kind in get_args(schemas.ScoreKind)
        assert f"{kind.score_kind} ({name}'s {kind.score_meaning})" in schemas.SCORE_KIND_DESCRIPTION


def imported_modules(path: Path) -> set[str]:
    """The first-party modules `path` imports (at any depth of the file), by their dotted names: for
    `from package import name`, package.name where that is a module, else the package."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found = ROOT.joinpath(*submodule.split(".")).with_suffix(".py").is_file()
                names.add(submodule if found else node.module)
    return {name for name in names if name.split(".")[0] in PACKAGES}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Inside service/: the engine knows nothing of HTTP or of Ray; HTTP nothing of Ray.
SERVICE_LAYERS = {"service.engine": ("service.http", "service.sharded"), "service.http": ("service.sharded",)}


def test_the_service_layers_point_down():
    offenders = {}
    for path in sorted((ROOT / "service").rglob("*.py")):
        name = module_name(path)
        for layer, below_it_never in SERVICE_LAYERS.items():
            if name.startswith(layer + "."):
                wrong = sorted(other for other in imported_modules(path) if other.startswith(below_it_never))
                if wrong:
                    offenders[name] = wrong
    assert offenders == {}


def test_no_module_imports_back_a_module_that_imports_it():
    graph = {module_name(path): imported_modules(path)
             for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    circles = set()

    def walk(name: str, trail: tuple[str, ...]) -> None:
        for other in sorted(graph.get(name, ())):
            if other in trail:
                circles.add(" -> ".join(trail[trail.index(other):] + (other,)))
            elif other not in seen:
                seen.add(other)
                walk(other, trail + (other,))

    for start in sorted(graph):
        seen = {start}
        walk(start, (start,))
    assert sorted(circles) == []


def test_refusals_get_their_status_codes_in_one_module():
    # Routes, limits and middleware raise the domain errors of service/errors.py; only service/http/status.py
    # picks their codes.
    offenders = {}
    for path in sorted((ROOT / "service").rglob("*.py")):
        if path.relative_to(ROOT / "service") == Path("http/status.py"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        found = sorted(names & {"HTTPException", "RequestValidationError"})
        found += [f"JSONResponse(status_code=...) at line {node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "JSONResponse"
                  and any(keyword.arg == "status_code" for keyword in node.keywords)]
        if found:
            offenders[path.name] = found
    assert offenders == {}


def test_a_device_string_has_one_meaning():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("gpu", "cuda:x", "CPU", ""):
        with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
            resolve_device(bad)


def test_every_reranker_saves_a_folder_the_loader_reads_back_with_equal_scores(tmp_path):
    passages = list(read_tsv(DEMO / "corpus.tsv").values())[:200]
    query, candidates = "join two paths", passages[:6]
    vocabulary = Vocabulary.build(passages)
    coattention, _ = CoAttentionReranker.create(
        vocabulary, CoAttentionConfig(len(vocabulary), hidden=8, feature_dim=4, dropout=0.0), glove=False, device="cpu"
    )
    rerankers = {
        "monobert": CrossEncoder(tiny_bert(tmp_path / "bert"), device="cpu"),
        "coattention": coattention,
        "generative": load_reranker(new_small_model(tmp_path / "gpt2", "causal", passages, vocab_size=500,
                                                    layers=1, width=32), device="cpu"),
    }
    for kind, reranker in rerankers.items():
        reranker.save(tmp_path / f"saved-{kind}")
        loaded = load_reranker(tmp_path / f"saved-{kind}", device="cpu")
        assert type(loaded) is type(reranker), kind
        np.testing.assert_allclose(loaded.score(query, candidates), reranker.score(query, candidates), atol=1e-5)


def test_a_saved_encoder_loads_back_with_its_pooling_and_equal_embeddings(tmp_path, encoder):
    encoder.save(tmp_path / "encoder")
    loaded = BiEncoder.load(tmp_path / "encoder", device="cpu")
    assert (loaded.spec.pooling, loaded.spec.similarity) == (encoder.spec.pooling, encoder.spec.similarity)
    texts = ["join two paths", "Return the absolute version of a path."]
    np.testing.assert_allclose(loaded.encode_queries(texts), encoder.encode_queries(texts), atol=1e-5)


def test_an_index_built_before_the_layout_change_still_loads_and_answers_as_a_new_build(tmp_path, encoder):
    old = tmp_path / "old"
    shutil.copytree(BEFORE_LAYOUT, old)
    manifest = read_manifest(old, verify_checksums=True)
    assert (manifest.dimension, manifest.similarity, manifest.count) == (384, "cosine", 6)
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text(head(DEMO / "corpus.tsv", 6), encoding="utf-8")
    build_index(BuildOptions(corpus, tmp_path / "new", bm25=True), encoder)
    searchers = [Searcher(folder, encoder, load=CPU) for folder in (old, tmp_path / "new")]
    for mode in ("dense", "bm25", "hybrid"):
        before, after = (searcher.search("join two paths", k=6, mode=mode) for searcher in searchers)
        assert [hit.id for hit in before] == [hit.id for hit in after], mode
        np.testing.assert_allclose([hit.score for hit in before], [hit.score for hit in after], atol=1e-6)


def test_only_the_ray_modules_import_ray_and_the_plain_service_never_loads_it():
    importers = sorted(str(path.relative_to(ROOT)) for package in PACKAGES for path in (ROOT / package).rglob("*.py")
                       if "ray" in imported_packages(path))
    assert importers == ["index_builder/ray_build.py", "service/sharded/command.py", "service/sharded/deployments.py",
                         "service/sharded/placement.py", "service/sharded/stop_signal.py"]
    script = "import sys, service.__main__, service.http.app, service.sharded.sharded_engine; print('ray' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"
