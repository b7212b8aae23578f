"""Build, write, load and search a candidate structure of any kind (retrieval.candidates.registry): what a
kind's module (kind.py's interface) leaves to all of them: the build's blocks and progress, the file and its
checks, the exact rescoring of the rows it proposes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import faiss
import numpy as np
from tqdm import tqdm

from retrieval import dense_index
from retrieval.candidates.kind import BLOCK, Structure, write_index
from retrieval.candidates.registry import KINDS, kind, owners
from retrieval.index_format import CandidateRecord, FileRecord, IndexFormatError

MAX_CANDIDATES = 10_000  # the most candidates one query may ask rescored (`candidates`)


def structure_params(name: str, given: dict[str, int | None],
                     label: Callable[[str], str] = str) -> dict[str, int]:
    """The parameters of a `name` structure: its defaults overridden by `given` (None: the default; 0 where
    a default is 0: chosen from the passages at build); ValueError for an unknown kind, a value under 1, or a
    parameter of another kind, each parameter named in the message by `label` (its name; `ann`: its flag)."""
    defaults = {param: spec.default for param, spec in kind(name).params.items()}
    given = {param: value for param, value in given.items() if value is not None}
    unknown = [param for param in given if param not in defaults]
    if unknown:
        others = sorted({other for param in unknown for other in owners(param)})
        if others:
            raise ValueError(f"{', '.join(map(label, unknown))}: for kind{'s' if len(others) > 1 else ''} "
                             f"{' and '.join(others)} only, not {name}")
        raise ValueError(f"unknown {name} parameters {sorted(unknown)}; known: {', '.join(defaults) or 'none'}")
    low = [f"{label(param)} {value}" for param, value in given.items()
           if value < 1 and (value, defaults[param]) != (0, 0)]
    if low:
        raise ValueError(f"{name} parameters must be at least 1, got {', '.join(low)}")
    return {**defaults, **given}


def build(flat: faiss.IndexFlat, name: str, params: dict[str, int] | None = None, *, depth: int | None = None,
          progress: bool = True, checkpoint: Path | None = None, identity: str = "") -> Structure:
    """A `name` structure over `flat`'s vectors, read in blocks of BLOCK (a tqdm bar counts them). `depth`:
    the candidates it rescores by default (the kind's default_depth). A kind that checkpoints (hnsw) saves
    its state to `checkpoint` now and then and, given one saved for the same `identity` (the vectors'
    sha256) and parameters, resumes from it."""
    spec = kind(name)
    params = spec.chosen(structure_params(name, params or {}), flat.ntotal, flat.d)
    spec.check(params, flat.d)
    index = spec.new_index(flat, params, progress, checkpoint, identity)
    total, saved = flat.ntotal, time.monotonic()
    with tqdm(total=total, initial=index.ntotal, desc=f"building {name}", unit=" passages",
              disable=not progress) as bar:
        for start in range(index.ntotal, total, BLOCK):
            block = flat.reconstruct_n(start, min(BLOCK, total - start))
            index.add(spec.codes(block))
            bar.update(len(block))
            if checkpoint is not None and spec.checkpoint_seconds is not None \
                    and time.monotonic() - saved > spec.checkpoint_seconds:
                spec.save(index, params, checkpoint, identity)
                saved = time.monotonic()
    spec.attach(index, flat)
    return Structure(name, index, params, depth or spec.default_depth(params))


def extended(structure: Structure, removed: np.ndarray, vectors: np.ndarray) -> Structure | None:
    """`structure` for a compacted generation: its rows `removed` (ascending) dropped and the later ones
    renumbered down, `vectors` added as the last rows (kind.Kind.extended); None for a kind that must be built
    again. The structure given is left as it is."""
    index = kind(structure.kind).extended(structure.index, removed, vectors)
    return None if index is None else Structure(structure.kind, index, dict(structure.params), structure.depth)


def write(structure: Structure, path: Path) -> None:
    """`structure` to `path`, through Python's file object, so a failed write (a full disk) raises OSError;
    fsynced. A kind that skips its storage (hnsw's graph as built) is written without vectors: they are
    index.faiss's."""
    spec = kind(structure.kind)
    with path.open("wb") as handle:
        write_index(structure.index, handle, binary=spec.binary, skips_storage=spec.without_vectors(structure.index))
        handle.flush()
        os.fsync(handle.fileno())


def load(path: Path, record: CandidateRecord, flat: faiss.IndexFlat, expected: FileRecord | None = None) -> Structure:
    """The structure `record` describes, read from `path` and checked to cover `flat`'s rows (a HNSW graph
    then searches `flat`'s vectors, which must stay on the CPU). `expected`: the manifest's record of the file,
    checked from the bytes read (dense_index.read_verified). IndexFormatError for a file that is not that."""
    spec = KINDS[record.kind]
    reader = faiss.read_index_binary if spec.binary else faiss.read_index
    flags = spec.read_flags()
    try:
        if expected is None:
            index = reader(str(path), flags)
        else:
            index = dense_index.read_verified(path, flags, expected, reader)
    except RuntimeError as error:  # FAISS's parse error, for a file damaged and not verified
        raise IndexFormatError(f"{path}: not a readable {record.kind} structure "
                               f"({str(error).strip().splitlines()[-1]})") from None
    if not isinstance(index, spec.index_type) or spec.rows(index) != flat.ntotal or index.d != spec.dimension(flat.d):
        raise IndexFormatError(f"{path}: a {type(index).__name__} of {spec.rows(index)} {index.d}-d rows, not the "
                               f"{record.kind} structure of index.faiss's {flat.ntotal} {flat.d}-d vectors")
    spec.attach(index, flat)
    return Structure(record.kind, index, dict(record.params), record.depth)


def candidates(structure: Structure, query_vectors: np.ndarray, depth: int, selector: faiss.IDSelector | None = None
               ) -> np.ndarray:
    """(len(query_vectors), depth) rows the structure proposes per query, -1 past what it found; with
    `selector`, only rows it lets through (retrieval.filtered_search: a filter's rows)."""
    vectors = np.ascontiguousarray(query_vectors, dtype=np.float32)
    return KINDS[structure.kind].propose(structure, vectors, depth, selector)


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


