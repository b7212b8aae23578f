"""What measuring a recall card costs (retrieval.candidates.recall.measure_recall, run by `ann`, `build --ann`
and each compaction that touches a structure), on clustered synthetic vectors:

    python bench/recall_card.py [--size 1000000] [--kind int8] [--runs 2]

`--size` rows of 384 dimensions around 1,000 centres (sigma 0.35, normalised), an exact flat index, the
structure built over it, then the card measured `--runs` times on its 1,000 held-out rows: seconds and the card;
then one exact search of those rows at k = 11 alone, the scan the card no longer runs beside its top-100 one.
"""
import argparse
import sys
import time
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrieval import dense_index  # noqa: E402
from retrieval.candidates import recall, structures  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--kind", default="int8")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((1000, 384)).astype(np.float32)
    noise = rng.standard_normal((args.size, 384)).astype(np.float32)
    vectors = centres[rng.integers(0, 1000, args.size)] + 0.35 * noise
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    flat = faiss.IndexFlatIP(384)
    flat.add(vectors)
    structure = structures.build(flat, args.kind)
    for _ in range(args.runs):
        started = time.perf_counter()
        card = recall.measure_recall(structure, flat)
        print(f"{args.size:,} rows, {args.kind}: the card in {time.perf_counter() - started:.2f} s (recall@10 "
              f"{card.recall_at_10:.4f}, recall@100 {card.recall_at_100:.4f}, {card.sample} held-out rows)")
    held_out = flat.reconstruct_batch(np.sort(rng.choice(args.size, size=min(1000, args.size), replace=False)))
    for k in (11, 101):
        started = time.perf_counter()
        dense_index.search(flat, held_out, k)
        print(f"one exact search of {len(held_out)} rows at k = {k}: {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
