"""`python -m service` runs on jemalloc where the system has it (SEARCH_ALLOCATOR auto), started again
with it preloaded under the same pid, and on the C library's malloc when told so; the Ray replicas of
`python -m service --ray` are given the same through their environment (their processes:
tests/test_sharded_serving.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.ports import unclaimed_ports
from service.engine.allocator import JEMALLOC_CONF, REEXECUTED, find_jemalloc, worker_env
from tests.conftest import ROOT

needs_jemalloc = pytest.mark.skipif(find_jemalloc() is None, reason="no libjemalloc installed (apt-get install libjemalloc2)")


def started(index: Path, **settings: str) -> tuple[subprocess.Popen, str, str]:
    """`python -m service` once /health answers: the process, its memory map, and its environment."""
    port = unclaimed_ports(1)[0]
    env = {name: value for name, value in os.environ.items()
           if name not in ("LD_PRELOAD", "MALLOC_CONF", REEXECUTED, "SEARCH_ALLOCATOR")}
    env.update({"SEARCH_INDEX_DIR": str(index), "SEARCH_PORT": str(port), "SEARCH_DEVICE": "cpu", **settings})
    server = subprocess.Popen([sys.executable, "-m", "service"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the service did not answer /health:\n{stopped(server)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    process = Path(f"/proc/{server.pid}")
    return server, (process / "maps").read_text(), (process / "environ").read_bytes().decode()


def stopped(server: subprocess.Popen) -> str:
    """Its output, once terminated."""
    server.terminate()
    return server.communicate(timeout=30)[0]


@needs_jemalloc
def test_by_default_the_service_runs_on_jemalloc_with_its_settings_in_the_same_process(small_index):
    server, maps, environ = started(small_index)
    log = stopped(server)
    assert "libjemalloc" in maps  # of the pid that was started: executed again, not a child
    assert f"MALLOC_CONF={JEMALLOC_CONF}\0" in environ
    assert f"malloc: jemalloc, MALLOC_CONF={JEMALLOC_CONF}" in log


@needs_jemalloc
def test_malloc_conf_in_the_environment_replaces_the_services(small_index):
    server, maps, environ = started(small_index, MALLOC_CONF="background_thread:false")
    stopped(server)
    assert "libjemalloc" in maps and "MALLOC_CONF=background_thread:false\0" in environ


@needs_jemalloc
def test_an_operators_own_preload_is_left_as_it_is(small_index):
    server, maps, environ = started(small_index, LD_PRELOAD="libm.so.6")
    log = stopped(server)
    assert "libjemalloc" not in maps and "LD_PRELOAD=libm.so.6\0" in environ
    assert "malloc: as LD_PRELOAD=libm.so.6 gives it" in log


def test_allocator_system_keeps_the_c_librarys_malloc(small_index):
    server, maps, environ = started(small_index, SEARCH_ALLOCATOR="system")
    log = stopped(server)
    assert "libjemalloc" not in maps and "MALLOC_CONF=" not in environ
    assert "malloc: the C library's" in log


def test_an_unknown_allocator_is_refused_with_exit_2_naming_the_setting(small_index):
    done = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SEARCH_INDEX_DIR": str(small_index), "SEARCH_ALLOCATOR": "tcmalloc"})
    assert done.returncode == 2 and done.stderr.startswith("error: SEARCH_ALLOCATOR:"), done.stderr


def test_starting_the_service_imports_nothing_heavy_before_the_allocator_is_chosen():
    # Executed again with jemalloc, whatever python -m service imported before would be imported twice.
    script = ("import sys, service.__main__; "
              "print(sorted({'torch', 'faiss', 'uvicorn', 'transformers'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


@needs_jemalloc
def test_ray_replicas_are_given_jemalloc_and_the_services_malloc_conf_unless_the_environment_sets_one(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    assert worker_env("auto") == worker_env("jemalloc") == {"LD_PRELOAD": find_jemalloc(), "MALLOC_CONF": JEMALLOC_CONF}
    monkeypatch.setenv("MALLOC_CONF", "narenas:1")
    assert worker_env("auto")["MALLOC_CONF"] == "narenas:1"


def test_ray_replicas_on_the_system_malloc_get_its_two_arenas_as_the_service_does(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert worker_env("system") == {"MALLOC_ARENA_MAX": "2"}
    monkeypatch.setenv("LD_PRELOAD", "libtcmalloc.so.4")  # under auto, an operator's own preload is left as it is
    assert worker_env("auto") == {"MALLOC_ARENA_MAX": "2"}


@needs_jemalloc
def test_ray_replicas_asked_for_jemalloc_preload_it_ahead_of_the_operators_own(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "libtcmalloc.so.4")
    assert worker_env("jemalloc")["LD_PRELOAD"] == f"{find_jemalloc()}:libtcmalloc.so.4"
