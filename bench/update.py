"""Incremental builds against a full build: 1% of a corpus changed, applied by `build --update` and by
`update --add --delete`.

    python bench/update.py [--size 20000] [--change 0.01] [--words 20 120] [--batch-size 64] [--chunk-size 2048]
        [--device cpu] [--work DIR] [--keep]

A corpus of --size generated passages (bench/scale.py's generated_texts: the demo corpus's words, --words
long, MS MARCO-like by default) is built once with the packaged MiniLM: the full build, the baseline.
Then --change of it changes: half of that replaced (new texts under their ids), a quarter added, a quarter
deleted. The change is applied to two copies of the full build (hard links, as `ann` makes a generation),
each timed: `build --update` given the edited corpus (the old order, deleted passages left out, replaced ones
in place, added ones at the end: the order both forms define), and `update --add FILE --delete IDS` given
the changes alone. Each row: seconds, passages encoded, and the full build's time over its own. The two
updated indexes are checked to hold the same ids in the same order and vectors within 1e-6, and their kept
vectors to be the full build's own. One process and one loaded model throughout: the model's loading, timed
once, is in none of the rows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scale import generated_texts, vocabulary  # noqa: E402
from index_builder.build import BuildOptions, build_index  # noqa: E402
from index_builder.build_update import build_update  # noqa: E402
from index_builder.update import ChangeOptions, apply_changes  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402
from retrieval import index_writer  # noqa: E402
from retrieval.index_format import INDEX_FILE, PASSAGES_FILE  # noqa: E402


def write_corpus(path: Path, records: list[tuple[str, str]]) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"id": pid, "text": text}) + "\n" for pid, text in records)
    return path


def contents(folder: Path) -> tuple[list[str], np.ndarray]:
    index = faiss.read_index(str(folder / INDEX_FILE))
    with sqlite3.connect(folder / PASSAGES_FILE) as connection:
        ids = [pid for (pid,) in connection.execute("SELECT id FROM passages ORDER BY row")]
    return ids, index.reconstruct_n(0, index.ntotal)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=20_000, help="passages in the corpus")
    parser.add_argument("--change", type=float, default=0.01, help="share of the corpus changed")
    parser.add_argument("--words", type=int, nargs=2, default=[20, 120], metavar=("LOW", "HIGH"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--work", type=Path, help="folder for the corpora and indexes (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep --work's contents")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    words = vocabulary()
    changed = max(4, round(args.size * args.change))
    replaced_count, added_count = changed // 2, changed // 4
    deleted_count = changed - replaced_count - added_count
    texts = generated_texts(rng, words, args.size + replaced_count + added_count, *args.words)
    base = [(f"p{i}", texts[i]) for i in range(args.size)]
    picked = rng.choice(args.size, size=replaced_count + deleted_count, replace=False)
    replaced = {f"p{i}": texts[args.size + n] for n, i in enumerate(picked[:replaced_count])}
    deleted = {f"p{i}" for i in picked[replaced_count:]}
    added = [(f"new{n}", texts[args.size + replaced_count + n]) for n in range(added_count)]
    edited = [(pid, replaced.get(pid, text)) for pid, text in base if pid not in deleted] + added

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-update-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        corpus = write_corpus(work / "corpus.jsonl", base)
        edited_corpus = write_corpus(work / "edited.jsonl", edited)
        additions = write_corpus(work / "add.jsonl", [*replaced.items(), *added])
        deletions = work / "delete.txt"
        deletions.write_text("".join(f"{pid}\n" for pid in sorted(deleted)))

        started = time.perf_counter()
        encoder = BiEncoder(device=args.device, batch_size=args.batch_size)
        load_seconds = time.perf_counter() - started
        full = work / "full"
        started = time.perf_counter()
        report = build_index(BuildOptions(corpus, full, chunk_size=args.chunk_size, overwrite=True), encoder)
        rows = [("full build", time.perf_counter() - started, report.encoded)]
        updated, diffed = work / "updated", work / "diffed"
        for copy in (updated, diffed):
            if copy.exists():
                shutil.rmtree(copy)
            index_writer.link_generation(full, copy)
        update = build_update(BuildOptions(edited_corpus, updated, chunk_size=args.chunk_size), encoder)
        rows.append(("build --update", update.seconds, update.encoded))
        diff = apply_changes(ChangeOptions(diffed, additions, deletions, chunk_size=args.chunk_size),
                             lambda manifest: encoder)
        rows.append(("update --add --delete", diff.seconds, diff.encoded))

        full_ids, full_vectors = contents(full)
        update_ids, update_vectors = contents(updated)
        diff_ids, diff_vectors = contents(diffed)
        assert update_ids == diff_ids == [pid for pid, _ in edited], "the updates' rows differ from the corpus"
        assert update.encoded == diff.encoded == replaced_count + added_count, (update.encoded, diff.encoded)
        np.testing.assert_allclose(update_vectors, diff_vectors, rtol=0, atol=1e-6)
        position = {pid: row for row, pid in enumerate(full_ids)}
        kept = [(row, position[pid]) for row, pid in enumerate(update_ids) if pid in position and pid not in replaced]
        assert np.array_equal(update_vectors[[a for a, _ in kept]], full_vectors[[b for _, b in kept]])
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\n{args.size:,} generated passages ({args.words[0]} to {args.words[1]} words), packaged MiniLM on "
          f"{args.device} ({torch.get_num_threads()} threads), loaded once in {load_seconds:.1f} s (in no row); "
          f"changed {changed} = {100 * changed / args.size:.3g}%: {replaced_count} replaced, {added_count} added, "
          f"{deleted_count} deleted\n")
    print(f"| {'run':<22} | {'seconds':>8} | {'encoded':>8} | {'full build / this':>17} |")
    print(f"|{'-' * 24}|{'-' * 9}:|{'-' * 9}:|{'-' * 18}:|")
    for name, seconds, encoded in rows:
        print(f"| {name:<22} | {seconds:>8.2f} | {encoded:>8} | {rows[0][1] / seconds:>16.1f}x |")


if __name__ == "__main__":
    main()
