"""Filters: a filtered dense search's p50 against the unfiltered exact scan, on a synthetic flat index with fields.

    python bench/filters.py [--size 1000000] [--dimension 384] [--queries 200] [--k 10] [--work DIR] [--keep]

An index of --size clustered unit vectors (bench/scale.py's clustered_vectors, around random centres) is written
through the index writer with metadata fields on every passage (`bucket`, a number 0 .. 999 drawn uniformly;
`source`, one of four strings; `tags`, a list of strings; `open`, a boolean; `tenant`, one of 1,000, row i
tenant i % 1000), and loaded by a Searcher, which reads
the fields into columns (timed: the load's cost of fields). Then, for each selectivity (a `bucket` range keeping
50%, 5% and 0.1% of the passages), --queries single-query dense searches at k=--k through `Searcher.rank`, each
filtered search followed by the same query unfiltered (the exact flat scan), so both see the same machine state;
one line per selectivity: the filtered and unfiltered p50 and their ratio, how the filtered search was answered
(retrieval/filtered_search.py: `postfilter`, the unfiltered scan read deeper; `among`, the matching rows only),
the mask's first evaluation (a filter's mask is then cached), and whether every filtered answer held only matching
passages. A line sums up against the goal: never slower than the unfiltered exact scan, faster when selective.
Then scoped keys (service/http/keys.py): each query from a random one of the 1,000 tenants, its scope
`{"tenant": ...}` ANDed with a 50% `bucket` filter as the service does for a scoped key (parsed and its mask
evaluated per search: a tenant's filter is rarely among the 16 masks cached), against the same 50% filter
unscoped (its mask cached): both p50s, their ratio, and whether every scoped answer held only the tenant's passages.
Queries are vectors (stored vectors plus noise), so no model runs; the encoder is loaded only for the Searcher's check.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scale import clustered_vectors, unit_vectors  # noqa: E402
from index_builder.build import encoder_record  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402
from retrieval import filtered_search, index_writer  # noqa: E402
from retrieval.fields import encode_fields  # noqa: E402
from retrieval.filters import evaluate  # noqa: E402
from retrieval.index_format import CorpusRecord, EncoderRecord  # noqa: E402
from retrieval.load_options import LoadOptions  # noqa: E402
from retrieval.searcher import Searcher  # noqa: E402

CHUNK = 100_000
BUCKETS = 1000
SELECTIVITIES = (0.5, 0.05, 0.001)
SOURCES = ("pubmed", "arxiv", "wiki", "news")
TENANTS = 1000


def build(out: Path, size: int, dimension: int, record: EncoderRecord, sigma: float,
          vectors: np.ndarray | None = None) -> float:
    """The index with fields at `out` (`vectors`, `size` of them, where given; else clustered ones); seconds taken."""
    started = time.perf_counter()
    rng = np.random.default_rng(size)
    centres = unit_vectors(np.random.default_rng(1), 3000, dimension)
    work = out.parent / f".{out.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    connection = index_writer.open_store(work)
    for first in tqdm(range(0, size, CHUNK), desc="passages", unit=" chunks", file=sys.stderr):
        count = min(CHUNK, size - first)
        buckets = rng.integers(0, BUCKETS, size=count)
        index_writer.insert_passages(connection, (
            (first + i, f"p{first + i}", f"passage {first + i}", first + i + 1, encode_fields({
                "bucket": int(bucket), "source": SOURCES[(first + i) % 4], "tags": [f"t{bucket % 7}"],
                "open": bool(bucket % 2), "tenant": f"tenant{(first + i) % TENANTS}"}))
            for i, bucket in enumerate(buckets)))
    connection.close()

    def parts():
        for first in tqdm(range(0, size, CHUNK), desc="vectors", unit=" chunks", file=sys.stderr):
            yield vectors[first:first + CHUNK] if vectors is not None else \
                clustered_vectors(rng, centres, min(CHUNK, size - first), sigma)

    count = index_writer.write_vectors(work, parts(), dimension)
    corpus = CorpusRecord(path=f"synthetic:{size}x{dimension}", format="jsonl", passages=count, skipped=0, sha256=None)
    index_writer.write_manifest(work, encoder=record, corpus=corpus, count=count, bm25=False)
    index_writer.move_into_place(work, out)
    return time.perf_counter() - started


def timed(function) -> tuple[float, object]:
    started = time.perf_counter()
    result = function()
    return 1000 * (time.perf_counter() - started), result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1_000_000, help="passages in the synthetic index")
    parser.add_argument("--dimension", type=int, default=384, help="vector dimension (the packaged MiniLM's, 384)")
    parser.add_argument("--queries", type=int, default=200, help="single-query searches per selectivity")
    parser.add_argument("--k", type=int, default=10, help="results per search")
    parser.add_argument("--sigma", type=float, default=0.05, help="noise a dimension around each cluster centre")
    parser.add_argument("--work", type=Path, help="folder for the index (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the index afterwards")
    args = parser.parse_args(argv)

    encoder = BiEncoder(device="cpu")  # only the record the Searcher checks, and the check itself
    if args.dimension != encoder.spec.dimension:
        parser.error(f"--dimension must be the packaged encoder's, {encoder.spec.dimension}, which the Searcher checks")
    record = encoder_record(encoder).model_copy(update={"dimension": args.dimension})
    root = Path(tempfile.mkdtemp(prefix="filters-", dir=args.work))
    try:
        index = root / "index"
        built = build(index, args.size, args.dimension, record, args.sigma)
        started = time.perf_counter()
        searcher = Searcher(index, encoder, load=LoadOptions(device="cpu"))
        loaded = time.perf_counter() - started
        print(f"{args.size:,} x {args.dimension} flat index with 5 fields: built in {built:.1f} s, loaded (with the "
              f"fields' columns) in {loaded:.1f} s; {args.queries} single queries at k={args.k} per selectivity")
        rng = np.random.default_rng(7)
        stored = searcher.index.reconstruct_batch(rng.integers(0, args.size, size=args.queries))
        vectors = stored + 0.05 * rng.standard_normal(stored.shape, dtype=np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        buckets = searcher.restrictions.columns.columns["bucket"].data
        searcher.rank([""], vectors[:1], searcher.request(args.k))  # warm: the first scan pages the vectors in
        ratios = {}
        for share in SELECTIVITIES:
            spec = {"bucket": {"$lt": share * BUCKETS}}
            parsed = searcher.parse_filter(spec)
            mask_ms, mask = timed(lambda: evaluate(parsed, searcher.restrictions.columns))
            restriction = searcher.restrictions.of(parsed)
            path = ("postfilter" if restriction.share >= filtered_search.POSTFILTER_SHARE else "among")
            filtered, unfiltered, only_matching = [], [], True
            for vector in vectors:
                ms, ranked = timed(lambda: searcher.rank([""], vector[None], searcher.request(args.k, filter=parsed)))
                filtered.append(ms)
                only_matching &= all(buckets[row] < share * BUCKETS for row, _ in ranked[0])
                unfiltered.append(timed(lambda: searcher.rank([""], vector[None], searcher.request(args.k)))[0])
            p50, base = statistics.median(filtered), statistics.median(unfiltered)
            ratios[share] = p50 / base
            print(f"selectivity {100 * share:g}% ({int(mask.sum()):,} passages): filtered p50 {p50:.2f} ms, "
                  f"unfiltered p50 {base:.2f} ms, ratio {p50 / base:.3f}; answered {path}; mask {mask_ms:.1f} ms "
                  f"(then cached); only matching passages: {'yes' if only_matching else 'NO'}", flush=True)
        never_slower = all(ratio <= 1.05 for ratio in ratios.values())  # 5%: the noise of a shared machine
        faster = ratios[min(SELECTIVITIES)] < 1 and ratios[0.05] < 1
        print("summary: filtered/unfiltered p50 " + ", ".join(f"{r:.3f} at {100 * s:g}%" for s, r in ratios.items())
              + f"; never slower than the unfiltered scan (within 5%): {'yes' if never_slower else 'NO'}; "
              f"faster when selective: {'yes' if faster else 'NO'}")
        spec = {"bucket": {"$lt": 0.5 * BUCKETS}}
        scoped, unscoped, inside = [], [], True
        for vector, tenant in zip(vectors, rng.integers(0, TENANTS, size=len(vectors))):
            both = {"$and": [{"tenant": f"tenant{tenant}"}, spec]}
            ms, ranked = timed(lambda: searcher.rank([""], vector[None], searcher.request(args.k, filter=both)))
            scoped.append(ms)
            inside &= all(row % TENANTS == tenant for row, _ in ranked[0])
            unscoped.append(timed(lambda: searcher.rank([""], vector[None], searcher.request(args.k, filter=spec)))[0])
        p50, base = statistics.median(scoped), statistics.median(unscoped)
        print(f"scoped keys, {TENANTS:,} tenants: scope AND a 50% filter p50 {p50:.2f} ms (parsed and masked per "
              f"search), the 50% filter unscoped p50 {base:.2f} ms, ratio {p50 / base:.3f}; only the tenant's "
              f"passages: {'yes' if inside else 'NO'}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}")


if __name__ == "__main__":
    main()
