"""Approximate candidate structures beside an index's exact vectors, and exact rescoring of what they propose.

A structure proposes `depth` rows per query; their scores are then computed from index.faiss's own fp32 vectors
with the kernel the flat search uses, and ordered by its rule (score descending, then row ascending), so an
approximate answer can differ from the exact one only by passages the structure missed, never by a score.

    hnsw    a HNSW graph (faiss IndexHNSWFlat, inner product) over index.faiss's vectors: the file holds the graph
            only (written with IO_FLAG_SKIP_STORAGE) and the loaded graph reads the flat index's vectors, so
            they are not held twice (memory-mapped, they are the page cache's, not the process's).
    ivf     an inverted file: k-means lists (their centres in a small HNSW graph) holding the vectors' 8-bit codes
            (faiss IndexIVFScalarQuantizer, inner product); a query scans the nprobe lists nearest to it.
    binary  the vectors' sign bits (d/8 bytes a passage) in a faiss IndexBinaryFlat, scanned by Hamming distance.
    int8    the vectors quantized to 8 bits a dimension (IndexScalarQuantizer QT_8bit, inner product), scanned.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from tqdm import tqdm

from retrieval import dense_index
from retrieval.index_format import CandidateRecord, FileRecord, IndexFormatError

KINDS = ("hnsw", "ivf", "binary", "int8")
HNSW_PARAMS = {"M": 32, "efConstruction": 200, "efSearch": 128}
# nlist: by default the power of two nearest 4 sqrt(N) (faiss's guide: 4 to 16 sqrt(N)), at most N / 39 (the
# training points faiss asks a list for).
IVF_PARAMS = {"nlist": 0, "nprobe": 32}
IVF_DEPTH = 128
IVF_QUANTIZER_M = 32  # links of the graph over the lists' centres
# Its search width, adding and searching: at faiss's default (16) some vectors were filed in a list far from
# their nearest, where no query looks (recall stopped at 0.94 on 5M however many lists were scanned). k-means
# assigns through the same graph at the default, several times faster: only where the centres fall depends on it.
IVF_COARSE_EF = 256
IVF_TRAIN_PER_LIST = 64
# Candidates rescored by default. HNSW: its efSearch, since its search holds that many candidates at the end
# anyway (returning them all costs only their rescoring). The scans: what recall@10 0.98 needed on 200k
# clustered 384-d vectors with neighbours as far apart as real ones (sign bits rank coarsely, 8-bit codes closely).
SCAN_DEPTH = {"binary": 4000, "int8": 256}
MAX_CANDIDATES = 10_000  # the most candidates one query may ask rescored (`candidates`)
BLOCK = 65_536  # vectors read from index.faiss at a time while a structure is built
TRAIN_ROWS = 1 << 18  # vectors the int8 quantizer's ranges are trained on
CHECKPOINT_SECONDS = 300.0  # a HNSW build saves its graph this often, so an interrupted one resumes
RECALL_SAMPLE = 1000
RECALL_SEED = 0
RECALL_THRESHOLD = 0.98
HELD_OUT = "held-out passages"


@dataclass
class Structure:
    """A loaded (or built) candidate structure: `index` is faiss's, `depth` the candidates rescored by default."""

    kind: str
    index: Any  # faiss.Index, or faiss.IndexBinary for `binary`
    params: dict[str, int]
    depth: int


PARAMS = {"hnsw": HNSW_PARAMS, "ivf": IVF_PARAMS, "binary": {}, "int8": {}}


def structure_params(kind: str, **given: int | None) -> dict[str, int]:
    """The parameters of a `kind` structure: its defaults (PARAMS) overridden by `given` (None: the default;
    ivf's nlist 0: chosen from the passages at build, see ivf_lists); ValueError for an unknown kind, a value
    under 1, or a parameter of another kind."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    given = {name: value for name, value in given.items() if value is not None}
    unknown = set(given) - set(PARAMS[kind])
    if unknown:
        owners = [other for other in KINDS if set(unknown) <= set(PARAMS[other])]
        if owners:
            raise ValueError(f"{', '.join(sorted(unknown))}: for kind {owners[0]} only, not {kind}")
        raise ValueError(f"unknown {kind} parameters {sorted(unknown)}; known: {', '.join(PARAMS[kind]) or 'none'}")
    low = [f"{name} {value}" for name, value in given.items() if value < 1 and (name, value) != ("nlist", 0)]
    if low:
        raise ValueError(f"{kind} parameters must be at least 1, got {', '.join(low)}")
    return {**PARAMS[kind], **given}


def ivf_lists(total: int) -> int:
    """ivf's default nlist for `total` passages."""
    wanted = 2 ** round(np.log2(max(4 * np.sqrt(max(total, 1)), 1)))
    return max(1, min(wanted, total // 39))


def default_depth(kind: str, params: dict[str, int]) -> int:
    if kind == "hnsw":
        return params["efSearch"]
    return IVF_DEPTH if kind == "ivf" else SCAN_DEPTH[kind]


def build(flat: faiss.IndexFlat, kind: str, params: dict[str, int] | None = None, *, depth: int | None = None,
          progress: bool = True, checkpoint: Path | None = None, identity: str = "") -> Structure:
    """A `kind` structure over `flat`'s vectors, read in blocks of BLOCK (a tqdm bar counts them). `depth`:
    the candidates it rescores by default (default_depth). A HNSW build saves its graph to `checkpoint` every
    CHECKPOINT_SECONDS and, given one saved for the same `identity` (the vectors' sha256) and parameters,
    resumes from it."""
    params = structure_params(kind, **(params or {}))
    total = flat.ntotal
    if kind == "hnsw":
        index = _resumed_hnsw(flat, params, checkpoint, identity) or _new_hnsw(flat.d, params)
    elif kind == "ivf":
        params = {**params, "nlist": params["nlist"] or ivf_lists(total)}
        index = _trained_ivf(flat, params["nlist"], progress)
    elif kind == "binary":
        index = faiss.IndexBinaryFlat(_binary_bits(flat.d))
    else:
        index = faiss.IndexScalarQuantizer(flat.d, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
        sample = np.random.default_rng(RECALL_SEED).choice(total, size=min(total, TRAIN_ROWS), replace=False)
        index.train(flat.reconstruct_batch(np.sort(sample)) if total else np.zeros((1, flat.d), dtype=np.float32))
    saved = time.monotonic()
    with tqdm(total=total, initial=index.ntotal, desc=f"building {kind}", unit=" passages",
              disable=not progress) as bar:
        for start in range(index.ntotal, total, BLOCK):
            block = flat.reconstruct_n(start, min(BLOCK, total - start))
            index.add(np.packbits(block > 0, axis=1) if kind == "binary" else block)
            bar.update(len(block))
            if checkpoint is not None and kind == "hnsw" and time.monotonic() - saved > CHECKPOINT_SECONDS:
                _save_checkpoint(index, params, checkpoint, identity)
                saved = time.monotonic()
    structure = Structure(kind, index, params, depth or default_depth(kind, params))
    if kind == "hnsw":
        _attach(structure.index, flat)  # its own copy of the vectors is freed: it searches `flat`'s
    return structure


def _new_hnsw(dimension: int, params: dict[str, int]) -> faiss.Index:
    index = faiss.IndexHNSWFlat(dimension, params["M"], faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = params["efConstruction"]
    index.hnsw.efSearch = params["efSearch"]
    return index


def _trained_ivf(flat: faiss.IndexFlat, nlist: int, progress: bool) -> faiss.Index:
    """An empty IVF index whose nlist centres are k-means over a seeded sample of `flat`'s vectors."""
    quantizer = faiss.IndexHNSWFlat(flat.d, IVF_QUANTIZER_M, faiss.METRIC_INNER_PRODUCT)
    index = faiss.IndexIVFScalarQuantizer(quantizer, flat.d, nlist, faiss.ScalarQuantizer.QT_8bit,
                                          faiss.METRIC_INNER_PRODUCT)
    quantizer.this.disown()
    index.own_fields = True
    index.cp.seed = RECALL_SEED
    if flat.ntotal:
        size = min(flat.ntotal, IVF_TRAIN_PER_LIST * nlist)
        sample = np.random.default_rng(RECALL_SEED).choice(flat.ntotal, size=size, replace=False)
        if progress:
            print(f"training ivf: k-means of {len(sample):,} vectors into {nlist:,} lists", file=sys.stderr, flush=True)
        index.train(flat.reconstruct_batch(np.sort(sample)))
    quantizer.hnsw.efSearch = IVF_COARSE_EF
    return index


def ivf_probes(structure: Structure, depth: int) -> int:
    """Lists an ivf query scans for `depth` candidates: nprobe at the default depth, proportionally more for
    more candidates (as hnsw's search widens to the candidates asked for), at most every list."""
    nprobe = structure.params["nprobe"]
    return min(structure.params["nlist"], max(nprobe, -(-nprobe * depth // structure.depth)))


def _binary_bits(dimension: int) -> int:
    return 8 * -(-dimension // 8)  # np.packbits pads the last byte with zeros


def _checkpoint_state(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".json")


def _save_checkpoint(index: faiss.Index, params: dict[str, int], checkpoint: Path, identity: str) -> None:
    """The graph so far (its vectors are index.faiss's first rows) and what it was built for, each by rename."""
    write(Structure("hnsw", index, params, 0), checkpoint.with_name(checkpoint.name + ".tmp"))
    os.replace(checkpoint.with_name(checkpoint.name + ".tmp"), checkpoint)
    state = _checkpoint_state(checkpoint)
    state.with_name(state.name + ".tmp").write_text(json.dumps({"identity": identity, "params": params}))
    os.replace(state.with_name(state.name + ".tmp"), state)


def _resumed_hnsw(flat: faiss.IndexFlat, params: dict[str, int], checkpoint: Path | None,
                  identity: str) -> faiss.Index | None:
    """The graph a build interrupted over the same vectors and parameters saved, holding its rows' vectors
    again; None where there is none."""
    if checkpoint is None or not checkpoint.is_file() or not _checkpoint_state(checkpoint).is_file():
        return None
    try:
        state = json.loads(_checkpoint_state(checkpoint).read_text())
        if state != {"identity": identity, "params": params}:
            return None
        index = faiss.read_index(str(checkpoint), faiss.IO_FLAG_SKIP_STORAGE)
    except (ValueError, RuntimeError):  # a checkpoint cut short: start over
        return None
    storage = faiss.IndexFlatIP(flat.d)
    for start in range(0, index.ntotal, BLOCK):
        storage.add(flat.reconstruct_n(start, min(BLOCK, index.ntotal - start)))
    storage.this.disown()  # the graph owns it from here on (own_fields), as a fresh IndexHNSWFlat owns its own
    index.storage, index.own_fields = storage, True
    return index


def _attach(index: faiss.Index, flat: faiss.IndexFlat) -> None:
    """Make a HNSW graph search `flat`'s vectors (which it must outlive: it keeps a reference)."""
    if index.storage is not None and index.own_fields:
        own = faiss.downcast_index(index.storage)
        own.this.acquire()  # freed with `own`, now Python's
    index.storage, index.own_fields = flat, False
    index.referenced_objects = [flat]


def write(structure: Structure, path: Path) -> None:
    """`structure` to `path`, through Python's file object, so a failed write (a full disk) raises OSError;
    fsynced. HNSW's graph is written without vectors: they are index.faiss's."""
    with path.open("wb") as handle:
        writer = faiss.PyCallbackIOWriter(handle.write)
        if structure.kind == "binary":
            faiss.write_index_binary(structure.index, writer)
        else:
            flags = faiss.IO_FLAG_SKIP_STORAGE if structure.kind == "hnsw" else 0
            faiss.write_index(structure.index, writer, flags)
        del writer
        handle.flush()
        os.fsync(handle.fileno())


def load(path: Path, record: CandidateRecord, flat: faiss.IndexFlat, expected: FileRecord | None = None) -> Structure:
    """The structure `record` describes, read from `path` and checked to cover `flat`'s rows (a HNSW graph
    then searches `flat`'s vectors, which must stay on the CPU). `expected`: the manifest's record of the file,
    checked from the bytes read (dense_index.read_verified). IndexFormatError for a file that is not that."""
    reader = faiss.read_index_binary if record.kind == "binary" else faiss.read_index
    flags = faiss.IO_FLAG_SKIP_STORAGE if record.kind == "hnsw" else 0
    try:
        if expected is None:
            index = reader(str(path), flags)
        else:
            index = dense_index.read_verified(path, flags, expected, reader)
    except RuntimeError as error:  # FAISS's parse error, for a file damaged and not verified
        raise IndexFormatError(f"{path}: not a readable {record.kind} structure "
                               f"({str(error).strip().splitlines()[-1]})") from None
    wanted = {"hnsw": faiss.IndexHNSWFlat, "ivf": faiss.IndexIVFScalarQuantizer, "binary": faiss.IndexBinaryFlat,
              "int8": faiss.IndexScalarQuantizer}
    dimension = _binary_bits(flat.d) if record.kind == "binary" else flat.d
    if not isinstance(index, wanted[record.kind]) or index.ntotal != flat.ntotal or index.d != dimension:
        raise IndexFormatError(f"{path}: a {type(index).__name__} of {index.ntotal} {index.d}-d rows, not the "
                               f"{record.kind} structure of index.faiss's {flat.ntotal} {flat.d}-d vectors")
    if record.kind == "hnsw":
        _attach(index, flat)
    return Structure(record.kind, index, dict(record.params), record.depth)


def candidates(structure: Structure, query_vectors: np.ndarray, depth: int, selector: faiss.IDSelector | None = None
               ) -> np.ndarray:
    """(len(query_vectors), depth) rows the structure proposes per query, -1 past what it found; with
    `selector`, only rows it lets through (retrieval.filtered_search: a filter's rows)."""
    vectors = np.ascontiguousarray(query_vectors, dtype=np.float32)
    if structure.kind == "hnsw":
        search = faiss.SearchParametersHNSW(efSearch=max(structure.params["efSearch"], depth))
        if selector is not None:
            search.sel = selector
        return structure.index.search(vectors, depth, params=search)[1]
    if structure.kind == "ivf":
        nprobe = ivf_probes(structure, depth)
        coarse = faiss.SearchParametersHNSW(efSearch=max(IVF_COARSE_EF, 2 * nprobe))
        search = faiss.SearchParametersIVF(nprobe=nprobe, quantizer_params=coarse)
        if selector is not None:
            search.sel = selector
        return structure.index.search(vectors, depth, params=search)[1]
    params = faiss.SearchParameters(sel=selector) if selector is not None else None
    if structure.kind == "binary":
        return structure.index.search(np.packbits(vectors > 0, axis=1), depth, params=params)[1]
    return structure.index.search(vectors, depth, params=params)[1]


def rescore(flat: faiss.IndexFlat, query_vectors: np.ndarray, rows: np.ndarray,
            k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows), each (len(query_vectors), k): `rows` (one list per query, -1 for none) scored exactly
    from `flat`'s stored fp32 vectors (IndexFlat.compute_distance_subset, no copy of them), the first k by score
    descending, then row ascending, as dense_index.search orders them. The kernel is the flat search's for
    fewer than faiss's BLAS threshold of queries (20), so a single query's scores are the exact scan's bit for
    bit; a larger batch's scan multiplies through BLAS, which may round the last bit otherwise."""
    vectors = np.ascontiguousarray(query_vectors, dtype=np.float32)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    scores = np.empty(rows.shape, dtype=np.float32)
    flat.compute_distance_subset(len(vectors), faiss.swig_ptr(vectors), rows.shape[1], faiss.swig_ptr(scores),
                                 faiss.swig_ptr(rows))
    scores[rows < 0] = -np.inf
    if rows.shape[1] < k:  # fewer candidates than k: pad as the flat search pads past its size
        pad = ((0, 0), (0, k - rows.shape[1]))
        scores, rows = np.pad(scores, pad, constant_values=-np.inf), np.pad(rows, pad, constant_values=-1)
    return dense_index.ordered(scores, rows, k)


def search(structure: Structure, flat: faiss.IndexFlat, query_vectors: np.ndarray, k: int,
           depth: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """dense_index.search's answer through the structure: `depth` candidates (default the structure's; at
    least k) rescored exactly. A query the structure found fewer than k rows for (a graph cut short) is
    searched exactly instead, so every query gets min(k, ntotal) rows."""
    vectors = np.ascontiguousarray(query_vectors, dtype=np.float32)
    depth = min(max(k, depth or structure.depth), flat.ntotal)
    if depth == 0:  # no passages (every one deleted): FAISS asks a structure for at least one row
        return dense_index.search(flat, vectors, k)
    scores, rows = rescore(flat, vectors, candidates(structure, vectors, depth), k)
    short = np.any(rows[:, :min(k, flat.ntotal)] < 0, axis=1)
    if np.any(short):
        scores[short], rows[short] = dense_index.search(flat, vectors[short], k)
    return scores, rows


@dataclass
class RecallCard:
    recall_at_10: float
    recall_at_100: float
    queries: str  # HELD_OUT or the caller's name for its queries
    sample: int


def measure_recall(structure: Structure, flat: faiss.IndexFlat, query_vectors: np.ndarray | None = None, *,
                   queries: str = HELD_OUT, sample: int = RECALL_SAMPLE, seed: int = RECALL_SEED) -> RecallCard:
    """Recall@10 and @100 of `search` at the structure's depth (at least k) against the exact flat search:
    the share of the exact top k the approximate top k holds, averaged over the queries. Queries: the
    `query_vectors` given, else `sample` stored vectors drawn with `seed`, each searched with itself
    excluded (its own row dropped from both lists), so a passage does not count as finding itself."""
    held_out = query_vectors is None
    if flat.ntotal == 0:  # an empty shard: nothing to miss
        return RecallCard(1.0, 1.0, queries, 0)
    if held_out:
        own = np.sort(np.random.default_rng(seed).choice(flat.ntotal, size=min(sample, flat.ntotal), replace=False))
        query_vectors = flat.reconstruct_batch(own)
    vectors = np.ascontiguousarray(query_vectors, dtype=np.float32)

    def recall(k: int) -> float:
        k = min(k, flat.ntotal - held_out)
        if k < 1 or len(vectors) == 0:
            return 1.0
        fetch = k + held_out
        exact = dense_index.search(flat, vectors, fetch)[1]
        found = search(structure, flat, vectors, fetch, max(structure.depth, fetch))[1]
        if held_out:
            exact, found = _without(exact, own, k), _without(found, own, k)
        return float(np.mean([len(set(e[:k]) & set(f[:k])) / k for e, f in zip(exact.tolist(), found.tolist())]))

    return RecallCard(recall(10), recall(100), queries, len(vectors))


def _without(rows: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    """Each query's first k rows other than its own."""
    return np.array([[row for row in ranked if row != mine][:k] for ranked, mine in zip(rows.tolist(), own.tolist())])
