"""`load_reranker`: one folder in, the right reranker kind out."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models.checkpoint import write_reranker_json
from models.cross_encoder import CrossEncoder
from models.reranker import Reranker, load_reranker
from tests.test_cross_encoder import tiny_bert


def test_a_hugging_face_classifier_without_reranker_json_is_monobert(tmp_path):
    reranker = load_reranker(tiny_bert(tmp_path / "plain"), device="cpu")
    assert isinstance(reranker, CrossEncoder) and isinstance(reranker, Reranker)
    scores = reranker.score("what is a path", ["a path names a file", "sockets"])
    assert scores.dtype == np.float32 and scores.shape == (2,)


def test_reranker_json_kind_monobert_is_the_cross_encoder(tmp_path):
    folder = tiny_bert(tmp_path / "declared")
    write_reranker_json(folder, "monobert")
    assert isinstance(load_reranker(folder, device="cpu"), CrossEncoder)


def test_unknown_kinds_and_folders_that_hold_no_reranker_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such reranker folder"):
        load_reranker(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="neither reranker.json nor"):
        load_reranker(tmp_path)
    (tmp_path / "reranker.json").write_text(json.dumps({"kind": "colbert"}))
    with pytest.raises(ValueError, match="'kind' must be one of monobert, coattention, generative"):
        load_reranker(tmp_path)
    (tmp_path / "reranker.json").write_text(json.dumps(["monobert"]))
    with pytest.raises(ValueError, match="an object with a string 'kind' is expected"):
        load_reranker(tmp_path)
