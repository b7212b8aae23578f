"""What a candidate structure kind is. A kind is one module beside this one holding one subclass of `Kind`,
and one line in registry.py; everything else (the manifest's kind, `ann`'s flags and their help, the
recall warning, the docs) reads it from there."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import faiss
import numpy as np

BLOCK = 65_536  # vectors read from index.faiss at a time while a structure is built
SEED = 0  # of every sample drawn: training points and held-out recall queries


@dataclass(frozen=True)
class Param:
    """One parameter of a kind: its default (0 where the kind chooses it from the passages at build), the
    `ann` flag that sets it (`--nprobe`), and the flag's help, whose last words say whether it raises recall."""

    default: int
    flag: str
    help: str
    raises_recall: bool = False  # at search time: the recall warning names it


@dataclass
class Structure:
    """A loaded (or built) candidate structure: `index` is faiss's, `depth` the candidates rescored by default."""

    kind: str
    index: Any  # faiss.Index, or faiss.IndexBinary for a binary kind
    params: dict[str, int]
    depth: int


class Kind:
    """One kind of structure. A subclass sets the class attributes and `new_index` and `propose`; the other
    methods have defaults that suit a scan over codes held in the structure itself."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line: what it holds, for `ann --help` and the docs
    params: ClassVar[dict[str, Param]] = {}
    depth: ClassVar[int]  # candidates rescored by default, where `default_depth` is not overridden
    index_type: ClassVar[type | tuple[type, ...]]  # the FAISS class (or classes) a file of this kind must hold
    binary: ClassVar[bool] = False  # a faiss.IndexBinary: written and read by the binary functions
    skips_storage: ClassVar[bool] = False  # written without its vectors (IO_FLAG_SKIP_STORAGE): index.faiss's
    checkpoint_seconds: ClassVar[float | None] = None  # a build saves its state this often (`save`) to resume

    def chosen(self, params: dict[str, int], total: int, dimension: int) -> dict[str, int]:
        """`params` with those left 0 (chosen at build) set for `total` passages of `dimension`."""
        return params

    def check(self, params: dict[str, int], dimension: int) -> None:
        """ValueError where `params` cannot hold for vectors of `dimension` (once `chosen`)."""

    def default_depth(self, params: dict[str, int]) -> int:
        return self.depth

    def depth_text(self) -> str:
        """The default depth, in words, for help and docs."""
        return str(self.depth)

    def new_index(self, flat: faiss.IndexFlat, params: dict[str, int], progress: bool,
                  checkpoint: Path | None, identity: str) -> Any:
        """The structure's FAISS index, trained where it needs it, holding none of `flat`'s rows (or, resumed
        from `checkpoint`, the first of them)."""
        raise NotImplementedError

    def codes(self, block: np.ndarray) -> np.ndarray:
        """What the FAISS index is given for `block` of vectors, added or searched."""
        return block

    def dimension(self, vectors: int) -> int:
        """The FAISS index's `d` over vectors of `vectors` dimensions."""
        return vectors

    def propose(self, structure: Structure, vectors: np.ndarray, depth: int,
                selector: faiss.IDSelector | None) -> np.ndarray:
        """(len(vectors), depth) rows, -1 past those found; only rows `selector` lets through, given one."""
        params = faiss.SearchParameters(sel=selector) if selector is not None else None
        return structure.index.search(self.codes(vectors), depth, params=params)[1]

    def extended(self, index: Any, removed: np.ndarray, vectors: np.ndarray) -> Any | None:
        """A copy of `index` (left as it is: searches read it) with the rows `removed` (ascending) dropped, the rows
        after each renumbered down by one, and `vectors` added as the last rows: the structure of a compacted
        generation (retrieval.compaction), trained as before. None where the kind cannot (built again). This
        default suits codes held in row order (faiss IndexFlatCodes), whose remove_ids shifts the rows so."""
        copy = faiss.clone_binary_index(index) if self.binary else faiss.clone_index(index)
        if len(removed):
            copy.remove_ids(faiss.IDSelectorBatch(np.asarray(removed, dtype=np.int64)))
        if len(vectors):
            copy.add(self.codes(np.ascontiguousarray(vectors, dtype=np.float32)))
        return copy

    def rows(self, index: Any) -> int:
        """The rows of index.faiss `index` covers (a load checks them against the file's)."""
        return index.ntotal

    def without_vectors(self, index: Any) -> bool:
        """Whether `index` is written without its vectors (IO_FLAG_SKIP_STORAGE): it reads index.faiss's."""
        return self.skips_storage

    def read_flags(self) -> int:
        """The FAISS flags a file of this kind is read with."""
        return faiss.IO_FLAG_SKIP_STORAGE if self.skips_storage else 0

    def attach(self, index: Any, flat: faiss.IndexFlat) -> None:
        """Called once a structure is built or loaded over `flat` (a graph that reads its vectors)."""

    def save(self, index: Any, params: dict[str, int], checkpoint: Path, identity: str) -> None:
        raise NotImplementedError

    def recall_hint(self, params: dict[str, int], depth: int) -> str:
        """The flags that raise a structure's recall, with their values now."""
        raised = [f"{param.flag} (now {params[name]})" for name, param in self.params.items() if param.raises_recall]
        return f"raise {', or '.join([*raised, f'--candidates (now {depth})'])}"


def sample_rows(total: int, size: int) -> np.ndarray:
    """`size` of `total` rows (all where fewer), drawn with SEED, ascending: the training sample of a build."""
    return np.sort(np.random.default_rng(SEED).choice(total, size=min(total, size), replace=False))


def write_index(index: Any, handle, *, binary: bool, skips_storage: bool) -> None:
    """`index` to the binary file object `handle` through Python's own writes, so a failed one raises OSError."""
    writer = faiss.PyCallbackIOWriter(handle.write)
    if binary:
        faiss.write_index_binary(index, writer)
    else:
        faiss.write_index(index, writer, faiss.IO_FLAG_SKIP_STORAGE if skips_storage else 0)
    del writer
