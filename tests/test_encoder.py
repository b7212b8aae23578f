"""The RepBERT bi-encoder on the packaged MiniLM weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.checkpoint import length_sorted_batches
from models.encoder import BiEncoder

TEXTS = [
    "Return the absolute version of a path.",
    "A very long passage " * 40,
    "short",
    "Evaluate an expression node or a string containing only a Python expression.",
]


def test_embeddings_equal_sentence_transformers_reference(encoder):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(encoder.path), device="cpu")
    reference.max_seq_length = encoder.spec.passage_max_tokens
    np.testing.assert_allclose(encoder.encode_passages(TEXTS), reference.encode(TEXTS), atol=1e-5)


def test_embedding_is_the_masked_mean_of_token_vectors(encoder):
    tokens = encoder.tokenizer(["Return the absolute version of a path."], return_tensors="pt")
    with torch.inference_mode():
        hidden = encoder.model(**tokens).last_hidden_state[0]
    mean = hidden.mean(dim=0)  # no padding in a batch of one: the plain mean is eq. 2
    expected = torch.nn.functional.normalize(mean, dim=0).numpy()
    np.testing.assert_allclose(encoder.encode_passages(TEXTS[:1])[0], expected, atol=1e-5)


def test_padding_in_a_batch_never_changes_an_embedding(encoder):
    together = encoder.encode_passages(TEXTS)
    alone = np.stack([encoder.encode_passages([text])[0] for text in TEXTS])
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_widths_rounded_up_for_the_gpu_change_no_embedding(encoder):
    """On a GPU batches are padded to a multiple of 32 tokens; the same rounding on the CPU must
    give the same vectors, the short texts included (more padding, same mask)."""
    exact = encoder.encode_passages(TEXTS)
    encoder.pad_multiple = 32
    try:
        rounded = encoder.encode_passages(TEXTS)
        queries = encoder.encode_queries(TEXTS)
    finally:
        encoder.pad_multiple = 1
    np.testing.assert_allclose(rounded, exact, atol=1e-5)
    np.testing.assert_allclose(queries, encoder.encode_queries(TEXTS), atol=1e-5)


def test_limits_default_to_the_models_own_maximum(encoder):
    # all-MiniLM-L6-v2's sentence_bert_config.json declares max_seq_length 256 (its positions: 512).
    assert (encoder.spec.query_max_tokens, encoder.spec.passage_max_tokens) == (256, 256)


def test_queries_are_truncated_to_their_token_limit():
    repbert_limits = BiEncoder(device="cpu", query_max_tokens=20, passage_max_tokens=256)
    assert (repbert_limits.spec.query_max_tokens, repbert_limits.spec.passage_max_tokens) == (20, 256)
    tokenizer = repbert_limits.tokenizer
    long_query = "aerodynamic heating of a wing " * 20
    truncated = tokenizer.decode(tokenizer(long_query, truncation=True, max_length=20)["input_ids"])
    np.testing.assert_allclose(
        repbert_limits.encode_queries([long_query]),
        repbert_limits.encode_queries([truncated.removeprefix("[CLS] ").removesuffix(" [SEP]")]),
        atol=1e-5,
    )
    assert repbert_limits.query_tokens(long_query) == 5 * 20 + 2  # uncut, [CLS] and [SEP] included


def test_a_query_tokenized_once_encodes_as_its_text_does():
    repbert_limits = BiEncoder(device="cpu", query_max_tokens=20)
    queries = ["aerodynamic heating of a wing " * 20, "what is a hash table", "x"]
    tokens = [repbert_limits.tokenize(query) for query in queries]
    assert [(len(t.ids), t.count) for t in tokens] == [(20, 102), (7, 7), (3, 3)]
    np.testing.assert_array_equal(repbert_limits.encode_tokens(tokens), repbert_limits.encode_queries(queries))
    with pytest.raises(ValueError, match="another encoder"):  # another tokenizer's ids, another limit
        BiEncoder(device="cpu").encode_tokens(tokens)


def test_sentence_transformers_folder_settings_are_honoured(encoder):
    spec = encoder.spec
    assert (spec.pooling, spec.similarity, spec.passage_segment_id) == ("mean", "cosine", 0)
    norms = np.linalg.norm(encoder.encode_queries(["what is a hash table"]), axis=1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-5)


def test_length_sorted_batches_cover_every_position_once_longest_first():
    lengths = [3, 9, 1, 7, 7, 2]
    batches = list(length_sorted_batches(lengths, 4))
    assert sorted(i for batch in batches for i in batch) == list(range(6))
    assert [lengths[i] for batch in batches for i in batch] == sorted(lengths, reverse=True)
    assert [len(b) for b in batches] == [4, 2]


def test_one_text_is_tokenized_as_the_tokenizer_itself_tokenizes_it(encoder, demo_queries):
    limit = encoder.spec.query_max_tokens
    texts = [*demo_queries.values(), "", "caf\u00e9 \u00df \u4e2d\u6587 \U0001f600", "[SEP] [CLS] [MASK] x",
             "tabs\tand\nnew lines", "heat " * 400]
    # The tokenizer's own call leaves truncation set on its backend: the service's copy is not touched.
    encoder.tokenizer("heat " * 10, truncation=True, max_length=4)
    for text in texts:
        tokens = encoder.tokenize(text)
        assert list(tokens.ids) == encoder.tokenizer(text, truncation=True, max_length=limit)["input_ids"]
        assert tokens.count == len(encoder.tokenizer(text, truncation=False)["input_ids"])
    assert encoder.tokenize("heat " * 400).count == 402
