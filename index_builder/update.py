"""`python -m index_builder update --index DIR [--add FILE] [--delete IDS_FILE]`: an index changed by a diff,
for users who have only the changes.

The --add file (any corpus a build reads) is built first into `.DIR.adding/` by `index_builder.build`,
through a ReusingEncoder (index_builder.build_update): a build like any other, resumed after a kill from its own
partial folder, with a stored vector for each passage whose text DIR already holds. The new generation is
then written in `.DIR.updating/` and swapped in under DIR's lock: DIR's rows in their order, the deleted
ones left out and each replaced one (an added id DIR holds) in its place, then the other added passages
in the --add file's order; every column of the passage store copied as stored, the vectors gathered from
the two indexes; BM25 and the candidate structures built again. The result equals a full build of the
corpus that order defines (ids, texts, vectors and rows). Deletions come first: an id both deleted and
added is added at the end. An id to delete that DIR does not hold is counted, and named on stderr.
"""

from __future__ import annotations

import shutil
import sqlite3
import sys
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import faiss
import numpy as np
from tqdm import tqdm

from index_builder.ann import AnnReport, add_in_place
from index_builder.build import BuildOptions, PassageEncoder, build_index, encoder_record
from retrieval import out_lock
from index_builder.build_update import (
    OldIndex,
    ReusingEncoder,
    UpdateReport,
    check_same_vectors,
    check_updatable,
    rebuilt_structures,
)
from index_builder.corpus_file import check_corpus_file, file_sha256
from index_builder.errors import BuildError
from retrieval import index_writer
from retrieval.corpus import DEFAULT_MAX_PASSAGE_BYTES, Passage, detect_format, read_corpus
from retrieval.fields import MAX_FIELDS, FieldTypes
from retrieval.index_format import INDEX_FILE, PASSAGES_FILE, Manifest, read_manifest

OLD, ADDED = 0, 1  # where a row of the new generation comes from
BLOCK = 65_536  # rows whose vectors are gathered at a time
SHOWN_MISSING = 5


@dataclass
class ChangeOptions:
    index: Path
    add: Path | None = None  # a corpus of new and replacing passages
    delete: Path | None = None  # passage ids to delete, one a line
    chunk_size: int = 2048
    skip_bad: bool = False
    restart: bool = False  # discard an interrupted build of the --add file
    max_passage_bytes: int = DEFAULT_MAX_PASSAGE_BYTES
    max_fields: int = MAX_FIELDS  # metadata fields the updated index may declare (at least the index's own)
    bm25: bool = True  # write a BM25 index over the new generation's passages (False: --no-bm25, none)


@dataclass
class _Plan:
    sources: np.ndarray  # OLD or ADDED, one per new row
    rows: np.ndarray  # the row in that source
    replaced: int
    deleted: int
    missing: list[str]  # ids to delete that the index does not hold


def apply_changes(options: ChangeOptions, load_encoder: Callable[[Manifest], PassageEncoder]) -> UpdateReport:
    """`update`: the index at `options.index` with the passages of `options.delete` removed and those of
    `options.add` put in (see the module); `load_encoder` gives the encoder for the index's manifest, asked only
    when there is something to add. BuildError or IndexFormatError (one line each) for bad input."""
    if options.add is None and options.delete is None:
        raise BuildError("update needs --add FILE, --delete IDS_FILE, or both")
    for path in (options.add, options.delete):
        if path is not None:
            check_corpus_file(path)
    started = time.perf_counter()
    index = options.index
    with out_lock.hold(index, "update"):
        old = OldIndex(index, check_updatable(index))
        deletes = read_ids(options.delete) if options.delete is not None else set()
        adding = index.parent / f".{index.name}.adding"
        encoded, skipped, resumed = 0, 0, 0
        if options.add is not None:
            build = BuildOptions(options.add, adding, options.chunk_size, options.skip_bad, overwrite=True,
                                 restart=options.restart, max_passage_bytes=options.max_passage_bytes,
                                 max_fields=max(options.max_fields, len(old.manifest.fields)),
                                 field_types=old.manifest.fields, field_types_of=f"the index {index}")
            if not options.skip_bad:
                check_fields(build)  # before the model loads and anything is encoded
            encoder = load_encoder(old.manifest)
            check_same_vectors(index, old.manifest.encoder, encoder_record(encoder))
            if not _finished(adding, options.add, encoder_record(encoder)):
                reusing = ReusingEncoder(encoder, old)
                report = build_index(build, reusing)
                encoded, resumed = reusing.encoded, report.resumed_chunks
            skipped = read_manifest(adding).corpus.skipped
        plan = _plan(old, adding if options.add is not None else None, deletes)
        if not len(plan.rows):
            raise BuildError(f"the update would leave {index} with no passages")
        work = index.parent / f".{index.name}.updating"
        if work.exists():  # left by an update that stopped while writing: written again (nothing is encoded there)
            shutil.rmtree(work)
        work.mkdir()
        try:
            ann = _write(work, old, adding, plan, skipped, options.bm25)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        index_writer.move_into_place(work, index)
        if adding.exists():
            shutil.rmtree(adding)
    if plan.missing:
        shown = ", ".join(repr(pid) for pid in plan.missing[:SHOWN_MISSING])
        print(f"note: {len(plan.missing)} ids to delete were not in {index}: {shown}"
              + (", ..." if len(plan.missing) > SHOWN_MISSING else ""), file=sys.stderr)
    count = len(plan.rows)
    appended = int(np.sum(plan.sources == ADDED)) - plan.replaced
    detail = (f"{plan.replaced} replaced in place, {appended} added at the end, {len(plan.missing)} ids to delete "
              "not in the index")
    return UpdateReport(index, count, count - encoded, encoded, plan.deleted, time.perf_counter() - started,
                        skipped, resumed, detail, ann)


def check_fields(build: BuildOptions) -> None:
    """BuildError naming the --add file's line and the index where a passage's metadata fields do not fit the
    index's (a field of another type, or past --max-fields): one pass reading the file, nothing encoded."""
    types = FieldTypes(max_fields=build.max_fields)
    types.know(build.field_types, build.field_types_of)
    with build.corpus.open("rb") as handle:
        for record, _ in read_corpus(handle, detect_format(build.corpus), max_bytes=build.max_passage_bytes):
            if isinstance(record, Passage):
                conflict = types.admit([record])
                if conflict:
                    raise BuildError(f"{build.corpus}: line {record.line}: {conflict[0][1]} "
                                     "(use --skip-bad to skip such lines)")


def read_ids(path: Path) -> set[str]:
    """The ids of an --delete file: one a line, surrounding white space and blank lines ignored. BuildError
    naming the line for one that is not UTF-8."""
    ids = set()
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise BuildError(f"{path}: line {number}: not UTF-8") from None
            pid = (text.removeprefix("\ufeff") if number == 1 else text).strip()
            if pid:
                ids.add(pid)
    return ids


def _finished(adding: Path, add: Path, encoder) -> bool:
    """Whether `adding` holds the build of this very --add file by this encoder, finished by an update that
    stopped before it swapped its result in (then it is not built again)."""
    try:
        manifest = read_manifest(adding, verify_checksums=True)
    except Exception:  # noqa: BLE001 - absent or unusable: built again
        return False
    return (manifest.corpus.path == str(add.resolve()) and manifest.encoder == encoder
            and manifest.corpus.sha256 == file_sha256(add))


def _plan(old: OldIndex, adding: Path | None, deletes: set[str]) -> _Plan:
    """The new generation's rows: where each comes from (see the module for the order)."""
    added: dict[str, int] = {}
    if adding is not None:
        with closing(sqlite3.connect(f"{(adding / PASSAGES_FILE).resolve().as_uri()}?mode=ro", uri=True)) as store:
            added = dict(store.execute("SELECT id, row FROM passages ORDER BY row"))
    sources, rows, placed, deleted = [], [], set(), set()
    with closing(sqlite3.connect(f"{(old.folder / PASSAGES_FILE).resolve().as_uri()}?mode=ro", uri=True)) as store:
        for row, pid in store.execute("SELECT row, id FROM passages ORDER BY row"):
            if pid in deletes:
                deleted.add(pid)
            elif pid in added:
                sources.append(ADDED)
                rows.append(added[pid])
                placed.add(pid)
            else:
                sources.append(OLD)
                rows.append(row)
    for pid, row in added.items():
        if pid not in placed:
            sources.append(ADDED)
            rows.append(row)
    return _Plan(np.array(sources, dtype=np.int8), np.array(rows, dtype=np.int64), len(placed), len(deleted),
                 sorted(deletes - deleted))


def _write(work: Path, old: OldIndex, adding: Path, plan: _Plan, skipped: int, bm25: bool) -> list[AnnReport]:
    """The new generation in `work`: passages, vectors, then the manifest (with BM25 and the content hashes)
    and the candidate structures, as a build writes them."""
    _copy_passages(work, old.folder, adding, plan)
    flats = {OLD: old.flat}
    if np.any(plan.sources == ADDED):
        flats[ADDED] = faiss.read_index(str(adding / INDEX_FILE), faiss.IO_FLAG_MMAP_IFC)
    count = index_writer.write_vectors(work, _vectors(plan, flats, old.flat.d), old.flat.d)
    manifest = old.manifest
    # The passages no longer come from one file: the corpus record keeps the old path and format, without a sha256.
    corpus = manifest.corpus.model_copy(update={"passages": count, "skipped": manifest.corpus.skipped + skipped,
                                                "sha256": None})
    index_writer.write_manifest(work, encoder=manifest.encoder, corpus=corpus, count=count,
                                bm25=bm25, write_sequence=manifest.write_sequence)
    return [add_in_place(work, structure, published=old.folder) for structure in rebuilt_structures(manifest)]


def _copy_passages(work: Path, old: Path, adding: Path, plan: _Plan) -> None:
    """Each new row's passage copied from its source's store with every column both stores have, so what a
    store holds beside id and text travels with it."""
    store = index_writer.open_store(work)
    try:
        store.execute("CREATE TEMP TABLE plan (new_row INTEGER PRIMARY KEY, source INTEGER, source_row INTEGER)")
        store.executemany("INSERT INTO temp.plan VALUES (?, ?, ?)",
                          zip(range(len(plan.rows)), plan.sources.tolist(), plan.rows.tolist()))
        columns = [name for name in _columns(store, "main") if name != "row"]
        for source, folder in ((OLD, old), (ADDED, adding)):
            if not np.any(plan.sources == source):
                continue
            store.execute("ATTACH DATABASE ? AS source", (str(folder / PASSAGES_FILE),))
            names = [name for name in columns if name in _columns(store, "source")]
            shared = ", ".join(f'"{name}"' for name in names)
            source_columns = ", ".join(f'passage."{name}"' for name in names)
            with store:
                store.execute(f"INSERT INTO main.passages (row, {shared}) SELECT plan.new_row, {source_columns} "
                              "FROM temp.plan AS plan JOIN source.passages AS passage ON passage.row = plan.source_row "
                              "WHERE plan.source = ? ORDER BY plan.new_row", (source,))
            store.execute("DETACH DATABASE source")
    finally:
        store.close()


def _columns(store: sqlite3.Connection, schema: str) -> list[str]:
    return [row[1] for row in store.execute(f"PRAGMA {schema}.table_info(passages)")]


def _vectors(plan: _Plan, flats: dict, dimension: int) -> Iterator[np.ndarray]:
    """The new rows' vectors, a block at a time, each gathered from its source index."""
    with tqdm(total=len(plan.rows), desc="gathering vectors", unit=" passages") as progress:
        for start in range(0, len(plan.rows), BLOCK):
            sources, rows = plan.sources[start : start + BLOCK], plan.rows[start : start + BLOCK]
            block = np.empty((len(rows), dimension), dtype=np.float32)
            for source, flat in flats.items():
                mask = sources == source
                if mask.any():
                    block[mask] = flat.reconstruct_batch(np.ascontiguousarray(rows[mask]))
            progress.update(len(rows))
            yield block
