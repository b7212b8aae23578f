"""ivf: an inverted file, k-means lists (their centres in a small HNSW graph) holding the vectors' 8-bit codes
(faiss IndexIVFScalarQuantizer, inner product); a query scans the nprobe lists nearest to it. The lists and
their search are shared with pq, which files product-quantized codes in them instead."""

from __future__ import annotations

import sys

import faiss
import numpy as np

from retrieval.candidates.kind import Kind, Param, Structure, sample_rows

QUANTIZER_M = 32  # links of the graph over the lists' centres
# Its search width, adding and searching: at faiss's default (16) some vectors were filed in a list far from
# their nearest, where no query looks (recall stopped at 0.94 on 5M however many lists were scanned). k-means
# assigns through the same graph at the default, several times faster: only where the centres fall depends on it.
COARSE_EF = 256
TRAIN_PER_LIST = 64
LIST_PARAMS = {
    # nlist 0: by default the power of two nearest 4 sqrt(N) (faiss's guide: 4 to 16 sqrt(N)), at most N / 39
    # (the training points faiss asks a list for).
    "nlist": Param(0, "--nlist", "k-means lists (default: the power of two nearest 4 sqrt(passages))"),
    "nprobe": Param(32, "--nprobe", "lists a query scans", raises_recall=True),
}


def lists(total: int) -> int:
    """The default nlist for `total` passages."""
    wanted = 2 ** round(np.log2(max(4 * np.sqrt(max(total, 1)), 1)))
    return max(1, min(wanted, total // 39))


def coarse_quantizer(dimension: int) -> faiss.IndexHNSWFlat:
    """The graph over the lists' centres, owned by the IVF index it is then given to (`own`)."""
    return faiss.IndexHNSWFlat(dimension, QUANTIZER_M, faiss.METRIC_INNER_PRODUCT)


def own(index, quantizer: faiss.IndexHNSWFlat) -> None:
    quantizer.this.disown()
    index.own_fields = True
    index.cp.seed = 0


def train(name: str, index, quantizer: faiss.IndexHNSWFlat, flat: faiss.IndexFlat, size: int, progress: bool) -> None:
    """k-means of `size` of `flat`'s vectors (a seeded sample) into the index's lists, and whatever else it
    trains on them; then the graph's search widened for filing and searching (COARSE_EF)."""
    if flat.ntotal:
        sample = sample_rows(flat.ntotal, size)
        if progress:
            print(f"training {name}: k-means of {len(sample):,} vectors into {index.nlist:,} lists",
                  file=sys.stderr, flush=True)
        index.train(flat.reconstruct_batch(sample))
    quantizer.hnsw.efSearch = COARSE_EF


def probes(structure: Structure, depth: int) -> int:
    """Lists a query scans for `depth` candidates: nprobe at the default depth, proportionally more for
    more candidates (as hnsw's search widens to the candidates asked for), at most every list."""
    nprobe = structure.params["nprobe"]
    return min(structure.params["nlist"], max(nprobe, -(-nprobe * depth // structure.depth)))


class Ivf(Kind):
    name = "ivf"
    summary = "k-means lists of the vectors' 8-bit codes (d bytes a passage), a query scanning the nearest nprobe"
    params = LIST_PARAMS
    depth = 128
    index_type = faiss.IndexIVFScalarQuantizer

    def chosen(self, params, total, dimension):
        return {**params, "nlist": params["nlist"] or lists(total)}

    def new_index(self, flat, params, progress, checkpoint, identity):
        quantizer = coarse_quantizer(flat.d)
        index = faiss.IndexIVFScalarQuantizer(quantizer, flat.d, params["nlist"], faiss.ScalarQuantizer.QT_8bit,
                                              faiss.METRIC_INNER_PRODUCT)
        own(index, quantizer)
        train(self.name, index, quantizer, flat, TRAIN_PER_LIST * params["nlist"], progress)
        return index

    def propose(self, structure, vectors, depth, selector):
        return search_lists(structure, vectors, depth, selector)

    def extended(self, index, removed, vectors):
        return extended_lists(index, removed, vectors)


def extended_lists(index, removed: np.ndarray, vectors: np.ndarray):
    """Kind.extended for an IVF index, whose lists hold each row's id: the removed ids dropped, the others
    renumbered down past them, the vectors filed under the next rows, into the lists trained before."""
    copy = faiss.clone_index(index)
    removed = np.asarray(removed, dtype=np.int64)
    if len(removed):
        copy.remove_ids(faiss.IDSelectorBatch(removed))
        lists = copy.invlists
        for number in range(copy.nlist):
            size = lists.list_size(number)
            if size:
                ids = faiss.rev_swig_ptr(lists.get_ids(number), size)  # the copy's own ids, changed in place
                ids -= np.searchsorted(removed, ids)
    if len(vectors):
        start = copy.ntotal
        copy.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32),
                          np.arange(start, start + len(vectors), dtype=np.int64))
    return copy


def search_lists(structure: Structure, vectors: np.ndarray, depth: int, selector) -> np.ndarray:
    nprobe = probes(structure, depth)
    coarse = faiss.SearchParametersHNSW(efSearch=max(COARSE_EF, 2 * nprobe))
    search = faiss.SearchParametersIVF(nprobe=nprobe, quantizer_params=coarse)
    if selector is not None:
        search.sel = selector
    return structure.index.search(vectors, depth, params=search)[1]
