"""FAISS threads per search: one thread against every core, per structure and batch size, on a quiet host and
on one loaded by busy processes, in one run:

    python bench/threads.py [--n 200000] [--kinds flat hnsw ivf pq int8 binary] [--batches 1 2 4 8 16 32 64]

N x 384 clustered vectors (bench/candidates.py's), each structure at its default parameters and depth. For
each host state (quiet, then loaded: one spinning process per core), kind and batch size, the searches run
through retrieval.candidates.structures.search (the flat scan through dense_index.search) with FAISS forced
to one thread, to every core, and as retrieval.threads chooses per call ("auto"); the three interleaved round
by round, each going first in turn (the first search of a round's vectors pays their cache misses). Printed:
ms per batch, p50 over the rounds, and which threads won. The crossover (the largest batch one thread still
wins) is what retrieval/threads.py's rule holds.
"""
import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.candidates import synthetic  # noqa: E402
from retrieval import dense_index  # noqa: E402
from retrieval.candidates import structures  # noqa: E402
from retrieval.threads import CORES, faiss_threads, search_threads  # noqa: E402


def spin(stop) -> None:
    while not stop.is_set():
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--sigma", type=float, default=0.1)
    parser.add_argument("--kinds", nargs="+", default=["flat", "hnsw", "ivf", "pq", "int8", "binary"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    flat, queries = synthetic(args.n, args.sigma)
    built = {}
    for kind in args.kinds:
        if kind != "flat":
            started = time.perf_counter()
            built[kind] = structures.build(flat, kind, {}, progress=False)
            print(f"{kind}: built in {time.perf_counter() - started:.1f} s", flush=True)
    print(f"{args.n:,} x {flat.d} clustered vectors; {CORES} cores; ms per batch, p50 of {args.rounds} rounds",
          flush=True)

    def searcher(kind: str):
        if kind == "flat":
            return lambda q: dense_index.search(flat, q, 10)
        return lambda q: structures.search(built[kind], flat, q, 10)

    stop = multiprocessing.Event()
    for host in ("quiet", "loaded"):
        spinners = [multiprocessing.Process(target=spin, args=(stop,), daemon=True)
                    for _ in range(CORES if host == "loaded" else 0)]
        for process in spinners:
            process.start()
        for kind in args.kinds:
            for batch in args.batches:
                auto = search_threads(batch, flat.ntotal)
                settings = {"1 thread": 1, f"{CORES} threads": CORES, f"auto ({auto})": auto}
                times: dict[str, list[float]] = {name: [] for name in settings}
                search = searcher(kind)
                for round_ in range(args.rounds):
                    vectors = queries[(round_ * batch) % (len(queries) - batch):][:batch]
                    order = list(settings.items())
                    for name, threads in order[round_ % 3:] + order[:round_ % 3]:  # each goes first in turn
                        with faiss_threads(threads):
                            started = time.perf_counter()
                            search(vectors)
                            times[name].append(1000 * (time.perf_counter() - started))
                p50 = {name: statistics.median(values) for name, values in times.items()}
                one, many = p50["1 thread"], p50[f"{CORES} threads"]
                print(f"{host:6} {kind:6} batch {batch:3}: " + ", ".join(f"{name} {ms:8.2f}" for name, ms in p50.items())
                      + f"  -> {'1 thread' if one <= many else f'{CORES} threads'} ({max(one, many) / min(one, many):.2f}x)",
                      flush=True)
        stop.set()
        for process in spinners:
            process.join()
        stop.clear()


if __name__ == "__main__":
    np.random.seed(0)
    main()
