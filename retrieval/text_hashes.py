"""Each passage's content hash: the sha256 of its text as stored, which is the text the encoder saw.

`text-sha256.npy` (one 32-byte row per passage, in row order) is written beside every index by the
index writer and listed in its manifest, so an incremental build (index_builder.build_update) finds the
vector of an unchanged passage without reading the old corpus or the old texts. The stored text is
what the corpus reader made of the record (TSV text stripped; JSONL title and text stripped and
joined by a space), and the encoder sees that text after the passage prefix, cut at the passage
token limit: both of those are in the manifest's encoder record, so two indexes with equal encoder
records give equal texts equal vectors.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path
from typing import Iterable

import numpy as np

from retrieval.index_format import PASSAGES_FILE, TEXT_HASHES_FILE, IndexFormatError, Manifest

DIGEST_BYTES = 32


def text_sha256(texts: Iterable[str]) -> np.ndarray:
    """(n, 32) uint8: the sha256 of each text's UTF-8 bytes."""
    digests = b"".join(hashlib.sha256(text.encode("utf-8")).digest() for text in texts)
    return np.frombuffer(digests, dtype=np.uint8).reshape(-1, DIGEST_BYTES).copy()


def stored_text_hashes(folder: Path) -> np.ndarray:
    """The hashes of the texts in `folder`'s passage store, in row order."""
    connection = sqlite3.connect(f"{(folder / PASSAGES_FILE).resolve().as_uri()}?mode=ro", uri=True)
    try:
        return text_sha256(text for (text,) in connection.execute("SELECT text FROM passages ORDER BY row"))
    finally:
        connection.close()


def write_text_hashes(work: Path) -> str:
    """`work/text-sha256.npy` from the passage store being written there, durably; its name."""
    tmp = work / (TEXT_HASHES_FILE + ".tmp")
    with tmp.open("wb") as handle:
        np.save(handle, stored_text_hashes(work))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, work / TEXT_HASHES_FILE)
    return TEXT_HASHES_FILE


def index_text_hashes(folder: Path, manifest: Manifest) -> np.ndarray:
    """The hashes of a finished index's passages, in row order: its file (IndexFormatError if its shape is not one
    row a passage), or for a format-1 index without one (retrieval.format_upgrade), computed from the stored texts."""
    if TEXT_HASHES_FILE not in manifest.files:  # read_manifest requires the file of format 2
        return stored_text_hashes(folder)
    hashes = np.load(folder / TEXT_HASHES_FILE)
    if hashes.shape != (manifest.count, DIGEST_BYTES) or hashes.dtype != np.uint8:
        raise IndexFormatError(f"{folder / TEXT_HASHES_FILE}: {hashes.shape} {hashes.dtype}, expected "
                               f"({manifest.count}, {DIGEST_BYTES}) uint8")
    return hashes


class HashLookup:
    """Finds, for each hash asked, a row holding it (the first such row), by a binary search over the
    hashes' first 8 bytes: memory is the hashes and one sorted key and row per passage."""

    def __init__(self, hashes: np.ndarray) -> None:
        self.hashes = np.ascontiguousarray(hashes, dtype=np.uint8)
        keys = _keys(self.hashes)
        self._order = np.argsort(keys, kind="stable")
        self._keys = keys[self._order]

    def rows(self, hashes: np.ndarray) -> np.ndarray:
        """int64, one per hash asked: a row holding it, or -1. Two texts whose hashes share their first 8
        bytes but not the rest may miss each other (then the passage is encoded again: never a wrong vector)."""
        if not len(self._keys) or not len(hashes):
            return np.full(len(hashes), -1, dtype=np.int64)
        hashes = np.ascontiguousarray(hashes, dtype=np.uint8)
        keys = _keys(hashes)
        positions = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
        rows = self._order[positions]
        found = (self._keys[positions] == keys) & np.all(self.hashes[rows] == hashes, axis=1)
        return np.where(found, rows, -1).astype(np.int64)


def _keys(hashes: np.ndarray) -> np.ndarray:
    return hashes[:, :8].copy().view("<u8").ravel()
