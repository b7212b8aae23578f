"""verify_checksums checks index.faiss from the very bytes FAISS loads: a tampered file is refused, and a
file swapped during loads (rewritten in place, or renamed over) is refused or loaded as the manifest
records it, never served otherwise."""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import faiss
import numpy as np
import pytest

from retrieval import dense_index
from retrieval.index_format import INDEX_FILE, IndexFormatError, read_manifest
from retrieval.load_options import LoadOptions
from retrieval.searcher import Searcher
from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from tests.test_service import one, settings_for

LOADS = 300
RELOADS = 30
SWAPS_AT_MOST = 200_000
SWAP_SECONDS_AT_MOST = 30.0
HOLD_S = 0.001  # each version stays up to this long: loads then meet whole files as well as swaps
READ_AND_MAPPED = [pytest.param(False, id="read"), pytest.param(True, id="mmap")]


@pytest.fixture()
def index_copy(tmp_path, small_index) -> Path:
    shutil.copytree(small_index, tmp_path / "index")
    return tmp_path / "index"


def vectors_of(index: faiss.Index) -> np.ndarray:
    return index.reconstruct_n(0, index.ntotal)


def vectors_zeroed(good: bytes) -> bytes:
    """`good` (a flat index file) with its vectors zeroed: the same size and a header FAISS parses, so only
    the checksum tells the two apart; searching it scores every passage 0."""
    index = faiss.deserialize_index(np.frombuffer(good, dtype=np.uint8))
    header = len(good) - index.ntotal * index.code_size
    return good[:header] + bytes(len(good) - header)


def flipped(good: bytes) -> bytes:
    return good[:1000] + bytes(b ^ 0xFF for b in good[1000:1004]) + good[1004:]


def zeroed(good: bytes) -> bytes:
    return bytes(len(good))


def appended(good: bytes) -> bytes:
    return good + b"\x00" * 8


@pytest.mark.parametrize("tamper", [vectors_zeroed, flipped, zeroed])
@pytest.mark.parametrize("mmap", READ_AND_MAPPED)
def test_a_tampered_index_file_is_refused_on_load(index_copy, encoder, tamper, mmap):
    path = index_copy / INDEX_FILE
    path.write_bytes(tamper(path.read_bytes()))
    with pytest.raises(IndexFormatError, match="sha256 differs from the manifest's"):
        Searcher(index_copy, encoder, load=LoadOptions(device="cpu", mmap=mmap))


@pytest.mark.parametrize("tamper,message", [(vectors_zeroed, "sha256 differs"), (zeroed, "sha256 differs"),
                                            (appended, "bytes read, manifest says")])
@pytest.mark.parametrize("mmap", READ_AND_MAPPED)
def test_load_index_refuses_bytes_other_than_the_expected_record(index_copy, tamper, message, mmap):
    record = read_manifest(index_copy).files[INDEX_FILE]
    path = index_copy / INDEX_FILE
    path.write_bytes(tamper(path.read_bytes()))
    with pytest.raises(IndexFormatError, match=message):
        dense_index.load_index(path, "cpu", mmap=mmap, expected=record)


@pytest.mark.parametrize("mmap", READ_AND_MAPPED)
def test_a_verified_load_gives_the_index_as_read_unverified(small_index, mmap):
    record = read_manifest(small_index).files[INDEX_FILE]
    verified = dense_index.load_index(small_index / INDEX_FILE, "cpu", mmap=mmap, expected=record)
    plain = dense_index.load_index(small_index / INDEX_FILE, "cpu")
    assert verified.codes.is_owned is not mmap  # mapped still maps, read still reads
    assert np.array_equal(vectors_of(verified), vectors_of(plain))


def test_without_verify_checksums_nothing_is_hashed_and_a_changed_file_loads(index_copy, encoder):
    path = index_copy / INDEX_FILE
    path.write_bytes(vectors_zeroed(path.read_bytes()))
    searcher = Searcher(index_copy, encoder, load=LoadOptions(device="cpu", verify_checksums=False))
    assert not vectors_of(searcher.index).any()


@contextmanager
def swapping(path: Path, good: bytes, bad: bytes, in_place: bool):
    """A thread swaps `path` between `good` and `bad` bytes in a loop, each held a random 0 .. HOLD_S, at most
    SWAPS_AT_MOST times and SWAP_SECONDS_AT_MOST seconds: in place as `cp` does (truncate, write), or by
    renaming a finished file over it as the index writer does; the file holds `good` again when the block ends."""
    stop = threading.Event()
    sources = [path.with_name("good.bytes"), path.with_name("bad.bytes")]
    for source, data in zip(sources, (good, bad)):
        source.write_bytes(data)
    link = path.with_name("swap.tmp")
    holds = random.Random(0)

    def swap() -> None:
        deadline = time.monotonic() + SWAP_SECONDS_AT_MOST
        for turn in range(SWAPS_AT_MOST):
            if stop.is_set() or time.monotonic() > deadline:
                break
            if in_place:
                path.write_bytes((good, bad)[turn % 2])
            else:
                os.link(sources[turn % 2], link)
                os.replace(link, path)
            time.sleep(holds.uniform(0, HOLD_S))

    swapper = threading.Thread(target=swap, name="index-swapper", daemon=True)
    swapper.start()
    try:
        yield
    finally:
        stop.set()
        swapper.join()
        path.write_bytes(good)


def loads_under_swaps(index_dir: Path, encoder, mmap: bool, in_place: bool) -> tuple[int, int]:
    """(loads that succeeded, of them those that served other vectors than the good file's), of LOADS
    verified loads while index.faiss is swapped with a same-size copy whose vectors are zeroed."""
    path = index_dir / INDEX_FILE
    good = path.read_bytes()
    expected = vectors_of(faiss.deserialize_index(np.frombuffer(good, dtype=np.uint8)))
    loaded = served_bad = 0
    with swapping(path, good, vectors_zeroed(good), in_place):
        for _ in range(LOADS):
            try:
                searcher = Searcher(index_dir, encoder, load=LoadOptions(device="cpu", mmap=mmap))
            except (IndexFormatError, RuntimeError):  # refused: the checksum, or FAISS on a half-written file
                continue
            loaded += 1
            # A read index is a copy; a mapped one maps a file that renames never change: both stay as loaded.
            served_bad += not np.array_equal(vectors_of(searcher.index), expected)
    return loaded, served_bad


# In place and mapped is left out: a mapped file rewritten in place changes what is served after any load
# (and a truncation under the mapping faults it), so only a load's moment could be checked, not its result.
@pytest.mark.parametrize("mmap,in_place", [(False, True), (False, False), (True, False)],
                         ids=["read-in-place", "read-renamed", "mmap-renamed"])
def test_an_index_file_swapped_during_loads_is_never_served_other_than_the_manifest_records(
        index_copy, encoder, mmap, in_place):
    loaded, served_bad = loads_under_swaps(index_copy, encoder, mmap, in_place)
    print(f"{loaded} of {LOADS} loads succeeded, {served_bad} of them served other vectors")
    assert served_bad == 0, f"{served_bad} of {loaded} successful loads served vectors other than the manifest's"
    assert loaded > 0  # some loads met a whole good file: the race was run, not only refused


def test_admin_reload_of_a_folder_swapped_during_reloads_never_serves_other_vectors(tmp_path, small_index, encoder):
    for name in ("serving", "swapped"):
        shutil.copytree(small_index, tmp_path / name)
    app = create_app(settings_for(tmp_path / "serving"), SearchEngine(Searcher(tmp_path / "serving", encoder)))
    path = tmp_path / "swapped" / INDEX_FILE
    good = path.read_bytes()
    expected = vectors_of(faiss.deserialize_index(np.frombuffer(good, dtype=np.uint8)))
    reloaded = served_bad = 0
    with swapping(path, good, vectors_zeroed(good), in_place=False):
        for _ in range(RELOADS):
            response = one(app, "POST", "/admin/reload", {"index": "swapped"})
            assert response.status_code in (200, 422), response.text  # 422: refused, the previous index serves
            if response.status_code == 200:
                reloaded += 1
                served_bad += not np.array_equal(vectors_of(app.state.runtime.engine.searcher.index), expected)
    print(f"{reloaded} of {RELOADS} reloads succeeded, {served_bad} of them served other vectors")
    assert served_bad == 0, f"{served_bad} of {reloaded} successful reloads served vectors other than the manifest's"
    assert reloaded > 0
