"""pq: ivf's k-means lists holding product-quantized codes (faiss IndexIVFPQ, inner product, on the residuals
to each list's centre): `bytes` sub-quantizers of 8 bits, d/8 by default, 48 bytes a passage at 384
dimensions, an eighth of int8's and ivf's codes. The structure for a collection whose vectors do not fit in
memory: the codes do, and the exact rescoring reads only the candidates' rows of a memory-mapped index.faiss."""

from __future__ import annotations

import faiss
import numpy as np

from retrieval.candidates import ivf
from retrieval.candidates.kind import Kind, Param

TRAIN_ROWS = 1 << 16  # at least this many vectors train the codebooks (faiss samples 256 a centroid of them)


class Pq(Kind):
    name = "pq"
    summary = "ivf's k-means lists holding product-quantized codes (d/8 bytes a passage by default)"
    params = {
        **ivf.LIST_PARAMS,
        "bytes": Param(0, "--pq-bytes", "bytes of a passage's code, one per sub-quantizer (default: d/8, "
                       "rounded down to a divisor of d)"),
    }
    # Clustered 384-d vectors at 48 bytes (bench/candidates.py N 0.1), recall@10 at 128 / 256 / 512 / 1024
    # candidates: 200k 0.995 / 0.999 / 0.999 / 0.999; 1M 0.890 / 0.971 / 0.998 / 1.000 (1.6 to 2.7 ms a query).
    depth = 512
    index_type = faiss.IndexIVFPQ

    def chosen(self, params, total, dimension):
        nlist = params["nlist"] or ivf.lists(total)
        code = params["bytes"] or max(divisor for divisor in range(1, max(1, dimension // 8) + 1)
                                      if dimension % divisor == 0)
        # 8 bits a sub-quantizer's code (256 centroids) where the training sample has that many vectors.
        bits = int(min(8, max(1, np.log2(max(self.training_rows(nlist, total), 2)))))
        return {**params, "nlist": nlist, "bytes": code, "nbits": bits}

    def check(self, params, dimension):
        if dimension % params["bytes"]:
            raise ValueError(f"pq: --pq-bytes {params['bytes']} must divide the vectors' {dimension} dimensions")

    @staticmethod
    def training_rows(nlist: int, total: int) -> int:
        return min(total, max(ivf.TRAIN_PER_LIST * nlist, TRAIN_ROWS))

    def new_index(self, flat, params, progress, checkpoint, identity):
        quantizer = ivf.coarse_quantizer(flat.d)
        index = faiss.IndexIVFPQ(quantizer, flat.d, params["nlist"], params["bytes"], params["nbits"],
                                 faiss.METRIC_INNER_PRODUCT)
        ivf.own(index, quantizer)
        ivf.train(self.name, index, quantizer, flat, self.training_rows(params["nlist"], flat.ntotal), progress)
        return index

    def propose(self, structure, vectors, depth, selector):
        return ivf.search_lists(structure, vectors, depth, selector)

    def extended(self, index, removed, vectors):
        return ivf.extended_lists(index, removed, vectors)
