"""Approximate candidate structures beside an index's exact vectors, and exact rescoring of what they propose.

A structure proposes `depth` rows per query; their scores are then computed from index.faiss's own fp32 vectors
with the kernel the flat search uses, and ordered by its rule (score descending, then row ascending), so an
approximate answer can differ from the exact one only by passages the structure missed, never by a score.

    kind.py        what a kind is: its parameters (with their flags), default depth, FAISS index, search
    hnsw.py ...    one module per kind (hnsw, ivf, binary, int8, pq)
    registry.py    KINDS, the one list of them: the manifest's `kind`, `ann`'s flags and the docs read it
    structures.py  build, write, load, propose (`candidates`), rescore and search, for every kind
    recall.py      the recall card: recall@k of a structure against the exact search

Nothing here is imported by this file, so that retrieval.index_format can read the registry."""
