"""The index directory: the contract between the index builder and the service.

    DIR/manifest.json     what was built, with what encoder, and checksums
    DIR/index.faiss       a flat inner-product FAISS index, row i = passage row i
    DIR/passages.sqlite   row -> (id, text, metadata fields), read on demand (see passage_store)
    DIR/text-sha256.npy   each row's content hash (retrieval.text_hashes), which an update matches passages by
    DIR/candidates-KIND.faiss   optional: an approximate candidate structure over index.faiss's
                          vectors (retrieval.candidates), listed in the manifest's `candidates`

Readers go through this module; `retrieval.index_writer` writes it, the manifest
last and atomically, so a directory with a manifest is a finished index. This is format 2; a folder of
format 1 is read through one upgrade step (retrieval.format_upgrade).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Collection, Literal

from pydantic import BaseModel, ValidationError

from models.checkpoint import file_sha256
from retrieval import format_upgrade
from retrieval.candidates.registry import KINDS

FORMAT_VERSION = 2
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.faiss"
PASSAGES_FILE = "passages.sqlite"
TEXT_HASHES_FILE = "text-sha256.npy"
SEALED_WRITES_FILE = "sealed-writes.log"
# A generation holding sealed writes is written in format 3, so that code which would not replay them refuses it.
SEALED_WRITES_FORMAT = 3


class IndexFormatError(Exception):
    """The directory is not a readable index of this format version."""


class EncoderRecord(BaseModel):
    name: str
    path: str | None  # None: the packaged default encoder
    dimension: int
    pooling: Literal["mean", "cls"]
    similarity: Literal["ip", "cosine"]
    query_segment_id: int
    passage_segment_id: int
    query_max_tokens: int
    passage_max_tokens: int
    weights_sha256: str
    # What computed the passages' vectors (models.onnx_backend); the service encodes queries the same
    # way unless told otherwise.
    backend: Literal["torch", "onnx", "onnx-int8"]
    export_sha256: str | None  # with an ONNX backend: the exported file's
    # Text put before each query / passage (models.encoder.EncoderSpec).
    query_prefix: str
    passage_prefix: str


class FileRecord(BaseModel):
    bytes: int
    sha256: str


class CorpusRecord(BaseModel):
    path: str
    format: Literal["tsv", "jsonl"]
    passages: int
    skipped: int
    # sha256 of the whole corpus file, so shards of different corpora never merge; None where the passages come
    # from more than one file (an update) or a format-1 index did not record it.
    sha256: str | None


class Bm25Record(BaseModel):
    library: str  # "bm25s <version>"
    k1: float
    b: float
    stemmer: str
    stopwords: str


class CandidateRecord(BaseModel):
    """One approximate candidate structure (retrieval.candidates) and its recall card: recall@10 and
    @100 of the approximate path (candidates, rescored exactly) against the exact flat search."""

    kind: Literal[tuple(KINDS)]  # retrieval.candidates.registry
    file: str  # relative to the directory, also listed (with its checksum) in `files`
    params: dict[str, int]  # the kind's (retrieval/candidates/KIND.py), those it chose at build included
    depth: int  # candidates rescored per query by default (at least k), the depth recall was measured at
    recall_at_10: float
    recall_at_100: float
    recall_queries: str  # "held-out passages" (stored vectors, each searched with itself excluded) or a file name
    sample: int  # queries the recall was measured on
    seconds: float  # building the structure, recall aside
    library: str  # "faiss <version>"


def candidates_file(kind: str) -> str:
    """The file of an index's candidate structure of `kind`: one per kind."""
    return f"candidates-{kind}.faiss"


class Manifest(BaseModel):
    """The record of one index, as written to disk by `sealed`."""

    format_version: int = FORMAT_VERSION
    encoder: EncoderRecord
    count: int
    built_at: str
    corpus: CorpusRecord
    files: dict[str, FileRecord]  # every file of the index, by path relative to the directory
    bm25: Bm25Record | None = None  # present when built with --bm25
    shard: str | None = None  # "i/N" for one job of a sharded build (retrieval.sharding); None for a whole index
    # Approximate candidate structures beside the exact vectors (`ann`, `build --ann`).
    candidates: list[CandidateRecord] = []
    # The passages' metadata fields and the type of each (retrieval.fields), e.g. {"year": "number"}; none for
    # a TSV corpus and a JSONL one without them.
    fields: dict[str, Literal["string", "number", "boolean", "string[]"]] = {}
    # The last write over HTTP this generation holds (retrieval.write_log: a compaction folded every write up to
    # it in); 0 for none. The writer replays the log's later writes over it.
    write_sequence: int = 0
    # The writes over HTTP sealed beside the rows (retrieval.compaction: a compaction below SEARCH_MERGE_SHARE): the
    # records of SEALED_WRITES_FILE, replayed over `count` rows as the writer's segment (retrieval.segment) when
    # the generation loads; its rows hold the writes before them. 0: none.
    sealed_writes: int = 0
    # sha256 of the manifest's own other fields (`manifest_digest`), so an edited manifest is refused; None in a
    # manifest not yet sealed.
    manifest_sha256: str | None = None

    @property
    def dimension(self) -> int:
        return self.encoder.dimension

    @property
    def similarity(self) -> str:
        return self.encoder.similarity


def manifest_digest(fields: dict) -> str:
    """sha256 of a manifest's fields (all but manifest_sha256 itself), in a canonical JSON form."""
    content = {name: value for name, value in fields.items() if name != "manifest_sha256"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def generation_id(manifest: Manifest) -> str:
    """What names one generation of an index (in /ready and beside every answer): the first 16 hex digits of
    its manifest's digest, so two generations that differ in any recorded way have two names."""
    return manifest.manifest_sha256[:16]


def sealed(manifest: Manifest) -> dict:
    """The manifest as written to disk: its fields and their digest."""
    fields = manifest.model_dump(exclude={"manifest_sha256"})
    return {**fields, "manifest_sha256": manifest_digest(fields)}


def file_record(path: Path) -> FileRecord:
    return FileRecord(bytes=path.stat().st_size, sha256=file_sha256(path))


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write, fsync, rename: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as handle:
        json.dump(payload, handle, indent=2)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_manifest(directory: str | Path, *, verify_checksums: bool = False,
                  hashed_on_load: Collection[str] = ()) -> Manifest:
    """The manifest of a finished index; IndexFormatError says what is wrong otherwise.

    `verify_checksums`: every file's sha256 is checked against the manifest here, except those named in
    `hashed_on_load`, whose caller checks them from the very bytes it loads (the Searcher passes
    INDEX_FILE, see dense_index.load_index's `expected`); their size is still checked here. A file
    checked here is opened again later, so one rewritten in between is not caught."""
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise IndexFormatError(f"{directory}: not an index directory (no {MANIFEST_FILE})")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise IndexFormatError(f"{path}: not valid JSON ({error})") from error
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version not in (format_upgrade.OLDEST, FORMAT_VERSION, SEALED_WRITES_FORMAT):
        raise IndexFormatError(f"{path}: format_version {version!r}, this code reads "
                               f"{format_upgrade.OLDEST} to {SEALED_WRITES_FORMAT}")
    digest = raw.get("manifest_sha256")  # always there from format 2; in format 1, from some version on
    if (digest is not None or version != format_upgrade.OLDEST) and digest != manifest_digest(raw):
        raise IndexFormatError(f"{path}: changed after it was written (its content does not match its manifest_sha256)")
    if version == format_upgrade.OLDEST:
        raw = format_upgrade.manifest(raw)
        raw["manifest_sha256"] = manifest_digest(raw)
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as error:
        raise IndexFormatError(f"{path}: {error}") from error
    for name in (INDEX_FILE, PASSAGES_FILE) + ((TEXT_HASHES_FILE,) if version != format_upgrade.OLDEST else ()):
        if name not in manifest.files:
            raise IndexFormatError(f"{directory}: {name} missing from the manifest")
    listed = SEALED_WRITES_FILE in manifest.files
    if not (version == SEALED_WRITES_FORMAT) == (manifest.sealed_writes > 0) == listed:
        raise IndexFormatError(f"{path}: format_version {version} with {manifest.sealed_writes} sealed writes "
                               f"({SEALED_WRITES_FILE} {'' if listed else 'not '}listed): sealed writes come in "
                               f"format {SEALED_WRITES_FORMAT} alone")
    kinds = [record.kind for record in manifest.candidates]
    for record in manifest.candidates:
        if record.file != candidates_file(record.kind) or record.file not in manifest.files:
            raise IndexFormatError(f"{path}: candidate structure {record.kind!r} names {record.file!r}, not "
                                   f"{candidates_file(record.kind)!r} listed in its files")
        if kinds.count(record.kind) > 1:
            raise IndexFormatError(f"{path}: two candidate structures of kind {record.kind!r}")
    for name, record in manifest.files.items():
        file = directory / name
        if not file.is_file():
            raise IndexFormatError(f"{directory}: {name} missing")
        if file.stat().st_size != record.bytes:
            raise IndexFormatError(f"{file}: {file.stat().st_size} bytes, manifest says {record.bytes}")
        if verify_checksums and name not in hashed_on_load and file_sha256(file) != record.sha256:
            raise IndexFormatError(f"{file}: sha256 differs from the manifest's")
    return manifest
