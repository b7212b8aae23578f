"""A write path that fails: a write the log cannot take (a full disk, the log removed or replaced under the writer)
is a JSON refusal naming the cause on a connection that stays usable, searches go on, /ready says why, and nothing
refused comes back at a restart; a compaction the disk refuses is backed off and loses nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from http.client import HTTPConnection
from pathlib import Path

import pytest

from retrieval.compaction import FolderReplaced, compact
from retrieval.index_format import read_manifest
from retrieval.searcher import Searcher
from retrieval.write_log import log_path, read
from service.engine import runtime as runtime_module
from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from tests.conftest import CPU
from tests.test_admission import serving, wait_until
from tests.test_service import one, settings_for
from tests.test_writes import base_corpus, base_index  # noqa: F401 - the module fixtures

NO_SPACE = "[Errno 28] No space left on device"


@contextmanager
def small_disk(folder: Path):
    """A 20 MB tmpfs at `folder`: a disk the test may fill (skipped where mounting is not permitted)."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small disk needs mounting a tmpfs, not permitted here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=True)  # a descriptor still open: detached


def fill(disk: Path, leave: int) -> Path:
    """A filler file taking all of `disk` but about `leave` bytes."""
    stats = os.statvfs(disk)
    filler = disk / "filler"
    with open(filler, "wb") as handle:
        handle.write(b"\0" * max(0, stats.f_bavail * stats.f_frsize - leave))
    return filler


def exchange(connection: HTTPConnection, method: str, path: str, body: dict | None = None) -> tuple[int, dict, dict]:
    """One request on `connection` (kept alive), and its status, headers and JSON body."""
    payload = None if body is None else json.dumps(body)
    connection.request(method, path, payload, {"content-type": "application/json"} if payload else {})
    response = connection.getresponse()
    return response.status, dict(response.getheaders()), json.loads(response.read())


def exchange_text(connection: HTTPConnection, path: str) -> str:
    connection.request("GET", path)
    return connection.getresponse().read().decode()


def passage(pid: str, count: int = 1) -> dict:
    return {"passages": [{"id": f"{pid}-{i}" if count > 1 else pid, "text": f"passage {pid} about joining two paths"}
                         for i in range(count)]}


def test_a_write_the_full_disk_refuses_is_a_507_naming_the_cause_on_a_connection_that_stays_usable(
        tmp_path, base_index, encoder):
    with small_disk(tmp_path / "disk") as disk:
        index = Path(shutil.copytree(base_index, disk / "index"))
        acknowledged = ["kept-0", "kept-1"]
        with serving(index, SearchEngine(Searcher(index, encoder, CPU)), writes=True) as (_, _, port):
            connection = HTTPConnection("127.0.0.1", port, timeout=60)
            for pid in acknowledged:
                assert exchange(connection, "POST", "/passages", passage(pid))[0] == 200
            filler = fill(disk, leave=0)
            # 3 passages: a record over a page, so the slack of the log's last page cannot take it
            status, headers, body = exchange(connection, "POST", "/passages", passage("refused", 3))
            assert (status, headers["content-type"]) == (507, "application/json"), body
            assert str(log_path(index)) in body["detail"] and NO_SPACE in body["detail"]
            assert "nothing of this write was kept" in body["detail"]
            held = connection.sock
            status, _, body = exchange(connection, "POST", "/passages", passage("refused-again", 3))
            assert status == 507 and NO_SPACE in body["detail"] and connection.sock is held
            status, _, body = exchange(connection, "POST", "/search", {"query": "join two paths", "k": 3})
            assert status == 200 and len(body["results"]) == 3 and connection.sock is held
            status, _, ready = exchange(connection, "GET", "/ready")
            assert status == 200 and ready["status"] == "ready"
            assert "write path is degraded" in ready["detail"] and NO_SPACE in ready["detail"]
            metrics = exchange_text(connection, "/metrics")
            assert "search_write_log_failures_total 2.0" in metrics and "search_write_path_degraded 1.0" in metrics
            filler.unlink()
            assert exchange(connection, "POST", "/passages", passage("kept-2"))[0] == 200  # on its own, no restart
            acknowledged.append("kept-2")
            assert exchange(connection, "GET", "/ready")[2]["detail"] is None
            assert "search_write_path_degraded 0.0" in exchange_text(connection, "/metrics")
            spec = exchange(connection, "GET", "/openapi.json")[2]
            assert {"503", "507"} <= set(spec["paths"]["/passages"]["post"]["responses"])
            connection.close()
        restarted = create_app(settings_for(index, writes=True), SearchEngine(Searcher(index, encoder, CPU)))
        try:
            assert [one(restarted, "GET", f"/passages/{pid}").status_code for pid in acknowledged] == [200] * 3
            refused = [f"{name}-{i}" for name in ("refused", "refused-again") for i in range(3)]
            assert [one(restarted, "GET", f"/passages/{pid}").status_code for pid in refused] == [404] * 6
            assert [record.seq for record in read(log_path(index))[0]] == [1, 2, 3]
        finally:
            restarted.state.runtime.writes.close()


def test_a_compaction_the_full_disk_refuses_is_backed_off_loses_nothing_and_ready_says_so(
        tmp_path, base_index, encoder, monkeypatch):
    monkeypatch.setattr(runtime_module, "COMPACT_BACKOFF_MIN_S", 0.5)  # a retry the test can wait for
    with small_disk(tmp_path / "disk") as disk:
        index = Path(shutil.copytree(base_index, disk / "index"))
        settings = settings_for(index, writes=True, compact_passages=3)
        app = create_app(settings, SearchEngine(Searcher(index, encoder, CPU)))
        runtime = app.state.runtime
        try:
            filler = fill(disk, leave=48 << 10)  # room for a few log records, not for a new generation
            for i in range(3):
                assert one(app, "POST", "/passages", passage(f"w{i}")).status_code == 200
            runtime.compacting.result(timeout=300)
            ready = one(app, "GET", "/ready").json()
            assert ready["status"] == "ready" and ready["index"]["write_sequence"] == 3
            assert "compaction failed" in ready["detail"] and "next try in" in ready["detail"]
            assert read_manifest(index).write_sequence == 0 and len(read(log_path(index))[0]) == 3
            assert not (disk / ".index.compacting").exists()
            assert one(app, "GET", "/passages/w2").status_code == 200
            filler.unlink()
            wait_until(lambda: time.monotonic() >= runtime.compact_not_before)
            assert one(app, "POST", "/passages", passage("w3")).status_code == 200  # due again: tried again
            runtime.compacting.result(timeout=300)
            assert one(app, "GET", "/ready").json()["detail"] is None
            assert read_manifest(index).write_sequence == 4 and read(log_path(index))[0] == []
            assert [one(app, "GET", f"/passages/w{i}").status_code for i in range(4)] == [200] * 4
        finally:
            runtime.writes.close()


@pytest.mark.parametrize("log_copied_back", [False, True])
def test_a_writer_whose_folder_and_log_were_replaced_refuses_writes_and_ready_says_why(
        tmp_path, base_index, encoder, log_copied_back):
    index = Path(shutil.copytree(base_index, tmp_path / "served"))
    app = create_app(settings_for(index, writes=True), SearchEngine(Searcher(index, encoder, CPU)))
    runtime = app.state.runtime
    try:
        assert one(app, "POST", "/passages", passage("kept")).status_code == 200
        saved = shutil.copy(log_path(index), tmp_path / "log-copy")
        shutil.rmtree(index)
        log_path(index).unlink()
        shutil.copytree(base_index, index)
        if log_copied_back:  # a file at the log's path again, but not the one the writer holds
            shutil.copy(saved, log_path(index))
        for _ in range(2):  # and it stays refused: only a restart helps
            refused = one(app, "POST", "/passages", passage("refused"))
            assert refused.status_code == 503 and "retry-after" not in refused.headers, refused.text
            detail = refused.json()["detail"]
            assert str(log_path(index)) in detail and "removed or replaced" in detail and "restart the writer" in detail
        assert one(app, "POST", "/passages/delete", {"ids": ["kept"]}).status_code == 503
        ready = one(app, "GET", "/ready").json()
        assert ready["status"] == "ready" and "removed or replaced" in ready["detail"]
        assert one(app, "POST", "/search", {"query": "join two paths", "k": 3}).status_code == 200
        with pytest.raises(FolderReplaced, match=f"{index} is no longer the folder this writer loaded"):
            compact(runtime.writes)
    finally:
        runtime.writes.close()
    restarted = create_app(settings_for(index, writes=True), SearchEngine(Searcher(index, encoder, CPU)))
    try:
        assert one(restarted, "GET", "/passages/refused").status_code == 404
        assert one(restarted, "GET", "/passages/kept").status_code == (200 if log_copied_back else 404)
    finally:
        restarted.state.runtime.writes.close()
