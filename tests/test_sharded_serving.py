"""Sharded serving on Ray Serve, over HTTP through HAProxy, in Serve's high-throughput mode as
`python -m service --ray` runs it (tests/conftest.py's Ray takes service.sharded.placement.job_env()): three
`build --shard i/3` shards answer as one flat index over the same passages, bm25 is refused, every
replica runs on the service's malloc, and a shard replica killed under traffic gives 503s naming it or
right answers, never wrong ones. One local Ray for the module; `python -m service --ray` itself, on a
Ray of its own beside it, exits 2 on what it could never serve and stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason="sharded serving needs ray[serve] (pip install 'ray[serve]')")
serve = pytest.importorskip("ray.serve", reason="sharded serving needs ray[serve] (pip install 'ray[serve]')")

from bench.ports import unclaimed_ports  # noqa: E402
from retrieval.sharding import ShardIndex  # noqa: E402
from service.engine.allocator import JEMALLOC_CONF, find_jemalloc  # noqa: E402
from service.engine.monitoring import Monitor  # noqa: E402
from service.engine.search_engine import SearchEngine  # noqa: E402
from service.http.admission import Occupancy  # noqa: E402
from service.settings import ServiceSettings  # noqa: E402
from service.sharded.command import shutdown_serve  # noqa: E402
from service.sharded.deployments import APP_NAME, build_application  # noqa: E402
from service.sharded.placement import (  # noqa: E402
    HAPROXY_MODE_PORTS,
    LOCAL_SERVE_ENV,
    job_env,
    placement_problems,
    ports_in_use,
    serve_ports,
)
from service.sharded.stop_signal import NAMESPACE, StopSignal, watch  # noqa: E402
from tests.conftest import CPU, RAY_CLIENT_TIMEOUT_S, ROOT  # noqa: E402
from tests.test_admission import metric  # noqa: E402
from tests.test_hardening_service import answer_of  # noqa: E402

SHARD_TIMEOUT_S = 3.0
CAP = 4  # SEARCH_MAX_CONCURRENT_REQUESTS: above the kill test's three clients at once


@pytest.fixture(scope="module")
def whole(merged_shards) -> SearchEngine:
    """One flat index over the very passages (and vectors) the shards hold, its queries encoded as the
    ingress encodes them (the default backend)."""
    return SearchEngine.open(merged_shards, load=CPU)


@pytest.fixture(scope="module")
def base_url(ray_session, small_shards):
    try:
        [port] = unclaimed_ports(1)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = ServiceSettings(device="cpu", shard_timeout_s=SHARD_TIMEOUT_S, max_concurrent_requests=CAP)
        # No CPUs reserved: four replicas share this machine's two cores.
        threads = {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "2"}}}
        application = build_application(small_shards, settings, shard_options={"num_cpus": 0},
                                        ingress_options={"num_cpus": 0, **threads})
        serve.run(application, name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        shutdown_serve()


@pytest.fixture(scope="module")
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as http:
        yield http


def expected(hits) -> list[dict]:
    return [{"id": h.id, "text": h.text, "score": h.score, "rank": h.rank, "retrieval_score": None, "rerank_score": None} for h in hits]


def test_ready_names_the_shards_and_counts_every_passage(client):
    assert client.get("/health").json()["status"] == "alive"
    ready = client.get("/ready")
    assert ready.status_code == 200
    index = ready.json()["index"]
    assert (index["count"], index["shards"], index["bm25"]) == (300, ["0/3", "1/3", "2/3"], False)


def replica_processes() -> list[Path]:
    """/proc of the application's replicas on the test session's Ray: processes Ray titles
    ray::ServeReplica:APP:DEPLOYMENT whose parent is this session's raylet."""

    def read(process: Path, name: str) -> bytes:
        try:
            return (process / name).read_bytes()
        except OSError:  # gone meanwhile
            return b""

    def parent(process: Path) -> bytes:
        fields = read(process, "stat").rsplit(b")", 1)[-1].split()  # state, then the parent's pid
        return fields[1] if len(fields) > 1 else b""

    processes = list(Path("/proc").glob("[0-9]*"))
    raylet = f"--raylet_socket_name={ray.nodes()[0]['RayletSocketName']}".encode()
    raylets = {process.name.encode() for process in processes if raylet in read(process, "cmdline")}
    title = f"ray::ServeReplica:{APP_NAME}:".encode()
    return [process for process in processes if read(process, "cmdline").startswith(title) and parent(process) in raylets]


@pytest.mark.skipif(find_jemalloc() is None or bool(os.environ.get("LD_PRELOAD"))
                    or os.environ.get("SEARCH_ALLOCATOR") == "system",
                    reason="no libjemalloc installed (apt-get install libjemalloc2), or this environment asks for "
                           "another malloc")
def test_every_replica_runs_on_jemalloc_with_the_services_malloc_conf(client):
    processes = replica_processes()
    assert len(processes) == 4, processes  # the ingress and three shards
    for process in processes:
        environ = dict(entry.split("=", 1) for entry in (process / "environ").read_text().split("\0") if "=" in entry)
        assert find_jemalloc() in (process / "maps").read_text(), environ.get("LD_PRELOAD")  # not Ray's own
        assert environ["MALLOC_CONF"] == os.environ.get("MALLOC_CONF", JEMALLOC_CONF)


@pytest.mark.parametrize("k", [10, 1000])
def test_sharded_search_over_http_equals_one_flat_index(client, whole, demo_queries, k):
    queries = list(demo_queries.values())[:50]
    for query in queries:
        response = client.post("/search", json={"query": query, "k": k})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["results"] == expected(whole.search(query, k).hits)  # ids, order and scores, exactly
        assert body["shards"] == {"answered": ["0/3", "1/3", "2/3"], "missing": []}
        assert body["search"] == "exact"  # the replicas described no candidate structure to the ingress
    batch = client.post("/search/batch", json={"queries": queries, "k": k}).json()
    assert [item["results"] for item in batch["results"]] == [expected(r.hits) for r in whole.search_batch(queries, k)]


def test_bm25_and_hybrid_are_refused_with_400_saying_why(client):
    for mode in ("bm25", "hybrid"):
        response = client.post("/search", json={"query": "join two paths", "mode": mode})
        assert response.status_code == 400
        assert "corpus-wide" in response.json()["detail"]


def test_past_the_concurrency_cap_the_ingress_answers_429_and_every_other_answer_is_right(base_url, whole,
                                                                                        demo_queries):
    queries = list(demo_queries.values())[:8]
    answers = {query: [r.id for r in whole.search(query, 10).hits] for query in queries}
    start = threading.Barrier(6 * CAP)
    outcomes: list[tuple[str, httpx.Response]] = []

    def client():
        with httpx.Client(base_url=base_url, timeout=60) as http:
            http.get("/health")  # connected before the burst
            start.wait()
            for query in queries:
                outcomes.append((query, http.post("/search", json={"query": query, "k": 10})))

    workers = [threading.Thread(target=client) for _ in range(6 * CAP)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    refused = [response for _, response in outcomes if response.status_code == 429]
    assert refused, "Serve queued every request past the cap instead of letting the app refuse it"
    assert "SEARCH_MAX_CONCURRENT_REQUESTS" in refused[0].json()["detail"] and refused[0].headers["retry-after"]
    for query, response in outcomes:
        assert response.status_code in (200, 429), response.text
        if response.status_code == 200:
            assert [r["id"] for r in response.json()["results"]] == answers[query]


def test_haproxy_closes_a_connection_whose_request_stops_half_sent_after_the_read_timeout(client, base_url):
    assert client.get("/health").status_code == 200  # the application is up, so the wait is HAProxy's alone
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /search HTTP/1.1\r\nHost: search\r\nContent-Type: appl")  # and then nothing
        sock.settimeout(RAY_CLIENT_TIMEOUT_S + 30)
        started = time.monotonic()
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]  # not Ray's default wait of an hour
    assert RAY_CLIENT_TIMEOUT_S - 0.5 <= waited < RAY_CLIENT_TIMEOUT_S + 10


def test_haproxy_refuses_a_request_head_past_its_buffer_and_serves_on(client, base_url):
    # The Ray path's head limit is HAProxy's (tune.bufsize less its 1 KiB rewrite room), not SEARCH_MAX_HEAD_BYTES.
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: search\r\nX-Pad: " + b"a" * (1 << 20) + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = answer_of(sock)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert client.get("/health").status_code == 200


def replica_name(deployment: str) -> str:
    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
             if actor["namespace"] == "serve" and f"#{deployment}#" in actor["name"]]
    assert len(names) == 1, names
    return names[0]


def test_a_killed_shard_replica_gives_503s_naming_it_or_right_answers_never_wrong_ones(client, base_url, whole,
                                                                                       demo_queries, small_shards):
    queries = list(demo_queries.values())[:20]
    answers = {query: expected(whole.search(query, 10).hits) for query in queries}
    outcomes: list[tuple[str, httpx.Response]] = []
    stop = threading.Event()

    def traffic():
        with httpx.Client(base_url=base_url, timeout=60) as http:
            while not stop.is_set():
                for query in queries:
                    outcomes.append((query, http.post("/search", json={"query": query, "k": 10})))

    workers = [threading.Thread(target=traffic) for _ in range(2)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 30
    while not outcomes and time.monotonic() < deadline:  # traffic is flowing before the kill
        time.sleep(0.1)
    answered_before_the_kill = len(outcomes)
    killed = replica_name("shard-1")
    ray.kill(ray.get_actor(killed, namespace="serve"), no_restart=True)
    # While the shard is down, an allow_partial request gets the other shards' answer, saying so. Serve
    # may hold a request for a dead replica until its replacement is up, within SEARCH_SHARD_TIMEOUT_S,
    # and then answer it whole: that is right too, so this asks for a while and checks what it gets
    # (the partial answer itself is pinned without Ray in tests/test_shard_merge.py).
    partials, deadline = [], time.monotonic() + 10
    while time.monotonic() < deadline:
        answer = client.post("/search", json={"query": queries[0], "k": 10, "allow_partial": True})
        assert answer.status_code in (200, 503), answer.text  # 503: no shard answered in time, not a wrong one
        if answer.status_code == 200 and answer.json()["shards"]["missing"]:
            partials.append(answer.json())
        time.sleep(0.05)
    # Then traffic until the replacement replica answers again (or a minute passes).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (outcomes and outcomes[-1][1].status_code == 200):
        time.sleep(1.0)
    stop.set()
    for worker in workers:
        worker.join()

    statuses = [response.status_code for _, response in outcomes]
    assert statuses[-1] == 200  # it came back
    # The kill was real and the traffic spanned it: another replica serves shard-1 now, and requests were
    # answered before the kill and after it.
    assert replica_name("shard-1") != killed
    assert 0 < answered_before_the_kill < len(outcomes)
    for query, response in outcomes:
        if response.status_code == 200:
            assert [(r["id"], r["rank"]) for r in response.json()["results"]] == [
                (r["id"], r["rank"]) for r in answers[query]]
            # batched with the other client's query, the encoder's padding may move the last bits
            assert [r["score"] for r in response.json()["results"]] == pytest.approx(
                [r["score"] for r in answers[query]], abs=1e-5)
        else:
            assert response.status_code == 503, response.text
            assert response.json()["detail"].startswith(
                ("shard 1/3 (shard-1) did not answer", "shard 1/3 (shard-1) failed"))

    shard = ShardIndex(small_shards[1], load=CPU)
    shard_one = {pid for pid, _ in shard.passages.get(range(shard.manifest.count))}
    rest = [hit for hit in whole.search(queries[0], 300).hits if hit.id not in shard_one][:10]
    for partial in partials:
        assert partial["shards"] == {"answered": ["0/3", "2/3"], "missing": ["1/3"]}
        assert [r["id"] for r in partial["results"]] == [hit.id for hit in rest]



def test_the_config_file_builder_places_each_shard_where_its_directory_is():
    from service.sharded.deployments import sharded_app

    application = sharded_app({"shards": ["/indexes/shard0of2", "/indexes/shard1of2"], "shard_replicas": 2,
                               "shard_gpus": 1, "shard_resources": True, "settings": {"gpu_fp16": True}})
    ingress = application._bound_deployment
    shards = [bound._bound_deployment for bound in ingress.init_args[3:]]
    assert ingress.init_args[0].gpu_fp16 and ingress.init_args[2] == ["shard-0", "shard-1"]
    assert ingress.init_args[1] is None  # no command to stop it: Serve's own stop (no drain)
    assert [(shard.name, shard.num_replicas) for shard in shards] == [("shard-0", 2), ("shard-1", 2)]
    assert [shard.ray_actor_options["resources"] for shard in shards] == [{"shard0of2": 1}, {"shard1of2": 1}]
    assert all(shard.ray_actor_options["num_gpus"] == 1 for shard in shards)


def test_what_no_node_could_hold_is_named_by_flag_and_resource(ray_session):
    nodes = ray.nodes()  # the test session's Ray: one node, 2 CPUs
    ingress = ("the ingress", 1, {"CPU": 1, "GPU": 0})
    shards = [(f"shard-{position}", 1, {"CPU": 1, "GPU": 0}) for position in range(3)]
    assert placement_problems([ingress, *shards], nodes) == [
        "the replicas reserve 4 CPU in all, and the cluster has 2 (--shard-cpus 0 --ingress-cpus 0.5 lets them "
        "share the cores)"]
    gpus = placement_problems([("shard-0", 2, {"CPU": 0, "GPU": 64})], nodes)
    assert [problem.split(" (")[0].split(", and the cluster")[0] for problem in gpus] == [
        "a replica of shard-0 reserves 64 GPU, and no node offers that", "the replicas reserve 128 GPU in all"]
    assert placement_problems([("the ingress", 1, {"CPU": 1.6}), ("a shard", 4, {"CPU": 0.1})], nodes) == []
    assert placement_problems([("shard-0", 1, {"CPU": 0, "shard0of3": 1})], nodes)[0].startswith(
        "a replica of shard-0 reserves 1 shard0of3, and no node offers that")
    assert placement_problems([("the ingress", 1, {"CPU": 0.5}), ("a shard", 6, {"CPU": 0})], nodes) == []


PORT_VARIABLES = ("SEARCH_PORT", *HAPROXY_MODE_PORTS)


def command_env() -> dict[str, str]:
    """The environment of a `python -m service --ray` beside the module's Serve: a local Ray of its own
    (no RAY_ADDRESS), the CPU, and free ports (distinct) for those Serve would otherwise bind at fixed ones."""
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    ports = {name: str(port) for name, port in zip(PORT_VARIABLES, unclaimed_ports(len(PORT_VARIABLES)))}
    # A drain long enough for a loaded machine: the tests check that the searches held are answered, not how fast.
    return {**env, "SEARCH_DEVICE": "cpu", "SEARCH_DRAIN_TIMEOUT_S": "300", **ports}


def serve_command(shards, *flags: str) -> list[str]:
    return [sys.executable, "-m", "service", "--ray", "--shards", *map(str, shards), *flags]


def last_error(stderr: str) -> str:
    return [line for line in stderr.splitlines() if line.startswith("error:")][-1]


def test_serving_what_a_local_ray_could_never_place_exits_2_at_once_naming_the_flags(small_shards):
    # More GPUs than any machine has (and the default CPU a replica: 4 for three shards and the ingress).
    done = subprocess.run(serve_command(small_shards, "--shard-gpus", "64"), cwd=ROOT, env=command_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    error = last_error(done.stderr)
    assert error.startswith("error: the application cannot be placed on this machine's Ray: a replica of a shard "
                            "(--shard-cpus, --shard-gpus) reserves 1 CPU, 64 GPU, and no node offers that"), error
    assert "the replicas reserve 4 CPU in all, and the cluster has" in error


def test_a_damaged_shard_folder_exits_2_with_the_replicas_own_error_naming_the_file(small_shards, tmp_path):
    shards = [tmp_path / shard.name for shard in small_shards]
    for shard, copy in zip(small_shards, shards):
        shutil.copytree(shard, copy)
    damaged = shards[1] / "index.faiss"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF  # one bit pattern of the last vector changed
    damaged.write_bytes(bytes(data))
    # Serve tries a failing replica 3 times by default, each a new worker loading the shard; once says the same.
    env = {**command_env(), "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1"}
    done = subprocess.run(serve_command(shards, "--shard-cpus", "0", "--ingress-cpus", "0"), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: the application could not start: shard-1: retrieval.index_format.IndexFormatError: {damaged}: "
        "sha256 differs from the manifest's")


def test_ports_serve_would_take_already_in_use_exit_2_naming_each_ones_variable(small_shards):
    env = command_env()
    with ExitStack() as held:
        for variable in PORT_VARIABLES:  # each checked on its own: the error lists each port found taken
            taken = held.enter_context(socket.socket())
            taken.bind(("127.0.0.1", int(env[variable])))
            taken.listen()
        done = subprocess.run(serve_command(small_shards), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    error = last_error(done.stderr)
    prefix = "error: ports this machine's Serve would listen on are in use: "
    assert error.startswith(prefix), error
    named = error.removeprefix(prefix).split(" (another service")[0].split(", ")
    assert sorted(named) == sorted(f"{variable}={env[variable]}" for variable in PORT_VARIABLES), error


LONG_QUERIES = [" ".join(["solar power and wind energy for homes"] * 40) + f" {i}" for i in range(48)]


@contextmanager
def running_command(shards, log: Path, *flags: str, until: str = "/ready"):
    """A `python -m service --ray` over `shards` on free ports, logging to `log`, once /ready answers 200 (or,
    with `until` "serving", once serve.run returned: every replica up); stopped at the end if still running.
    Yields the process, its environment and its base URL."""
    env = command_env()
    with log.open("w") as output:
        process = subprocess.Popen(serve_command(shards, "--shard-cpus", "0", "--ingress-cpus", "0", *flags), cwd=ROOT,
                                   env=env, stdout=output, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{env['SEARCH_PORT']}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if until == "serving":
                    if "INFO service: serving " in log.read_text():
                        break
                elif httpx.get(f"{base}/ready", timeout=5, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield process, env, base
    finally:
        if process.poll() is None:  # a test that failed: its own stop, or a kill would leave HAProxy listening
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()


def replica_sessions(env: dict[str, str]) -> dict[str, int]:
    """The connections HAProxy holds open to each ingress replica now, from its Prometheus page."""
    page = httpx.get(f"http://127.0.0.1:{env['RAY_SERVE_HAPROXY_METRICS_PORT']}/metrics", trust_env=False).text
    return {line.split('server="')[1].split('"')[0]: int(float(line.split()[-1])) for line in page.splitlines()
            if line.startswith("haproxy_server_current_sessions{") and 'server="SERVE_REPLICA_' in line}


def assert_answered_whole(answer: httpx.Response) -> None:
    assert answer.status_code == 200, answer.text
    assert [len(item["results"]) for item in answer.json()["results"]] == [3] * len(LONG_QUERIES)


def test_sigterm_answers_the_searches_in_flight_exits_0_and_frees_every_port_it_served_on(small_shards, tmp_path):
    log = tmp_path / "service.log"
    # Signalled once /ready answers (a readiness probe's view), most often before serve.run has returned.
    with running_command(small_shards, log) as (process, env, base):
        # A batch of long queries (seconds of encoding here) in flight when the signal comes is answered
        # whole: the ingress drains before Serve deletes the shards (which had failed it with 503).
        in_flight = ThreadPoolExecutor(1).submit(httpx.post, f"{base}/search/batch",
                                                 json={"queries": LONG_QUERIES, "k": 3}, timeout=120, trust_env=False)
        deadline = time.monotonic() + 60  # the batch in the ingress before the signal, not on its way
        while metric(base, "search_in_flight_requests") < 1:
            assert time.monotonic() < deadline and not in_flight.done(), "the batch never was in flight"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert_answered_whole(in_flight.result(timeout=180))
        assert process.wait(timeout=180) == 0, log.read_text()[-3000:]
    assert "INFO service: stopped" in log.read_text()
    ports = {int(env[name]): (name, "0.0.0.0") for name in PORT_VARIABLES}
    assert ports_in_use(ports) == []  # HAProxy and Serve's proxies gone with it


def test_sigterm_drains_every_ingress_replica_the_busy_one_too(small_shards, tmp_path):
    log = tmp_path / "service.log"
    with running_command(small_shards, log, "--ingress-replicas", "2", until="serving") as (process, env, base):
        deadline = time.monotonic() + 60
        while len(replica_sessions(env)) < 2:  # HAProxy told of both replicas
            assert time.monotonic() < deadline, replica_sessions(env)
            time.sleep(0.2)
        # Three batches, two in one replica: Serve's router, which a handle call goes through, prefers the
        # replica with fewer requests in it.
        with ThreadPoolExecutor(3) as pool:
            batches = []
            for held in (1, 2, 3):  # each once the last is at its replica: HAProxy sends it to the one with fewer
                batches.append(pool.submit(httpx.post, f"{base}/search/batch",
                                           json={"queries": LONG_QUERIES, "k": 3}, timeout=120, trust_env=False))
                while sum(replica_sessions(env).values()) < held:
                    assert time.monotonic() < deadline and not any(b.done() for b in batches), replica_sessions(env)
                    time.sleep(0.05)
            assert sorted(replica_sessions(env).values()) == [1, 2]  # the busy replica and the idler both in it
            time.sleep(1.0)  # their heads read and counted in (microseconds; their encoding takes seconds)
            process.send_signal(signal.SIGTERM)
            for batch in batches:
                assert_answered_whole(batch.result(timeout=180))
        assert process.wait(timeout=180) == 0, log.read_text()[-3000:]
    said = [line for line in log.read_text().splitlines() if " service: " in line]
    assert any(line.endswith("INFO service: ingress drained: 2 of 2 replicas, 0 searches still in them")
               for line in said), said


def test_a_replica_drains_on_its_commands_stop_and_serves_again_if_the_command_dies_leaving_it(ray_session):
    name = f"stop-{uuid.uuid4().hex}"
    stop = StopSignal.options(name=name, namespace=NAMESPACE).remote()
    occupancy = Occupancy(cap=4, retry_after_s=1, monitor=Monitor(window=10))

    async def until(condition, what: str) -> None:
        deadline = time.monotonic() + 30
        while not await condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    async def registered() -> bool:
        return (await stop.reports.remote())[0] == ["replica-a"]

    async def stopping() -> bool:
        return occupancy.stopping

    async def reported() -> bool:
        return (await stop.reports.remote())[1] == {"replica-a": 0}

    async def scenario() -> None:
        occupancy.in_flight = 1  # a search in the replica
        watching = asyncio.create_task(watch(name, "replica-a", occupancy, resume_after_s=0.5))
        await until(registered, "the replica never registered")
        await stop.stop.remote(30.0)
        await until(stopping, "the replica never stopped")
        assert occupancy.full() and not watching.done()  # refuses new searches, waits for the one in it
        assert await stop.reports.remote() == (["replica-a"], {})
        occupancy.in_flight = 0  # answered
        await until(reported, "the drained replica never reported")
        ray.kill(stop)  # the command gone, and the application it should have deleted still up
        await asyncio.wait_for(watching, 30)
        assert not occupancy.stopping and not occupancy.full()

    asyncio.run(scenario())


def test_a_replica_of_an_application_with_no_stop_signal_serves_on(ray_session):
    occupancy = Occupancy(cap=4, retry_after_s=1, monitor=Monitor(window=10))
    asyncio.run(asyncio.wait_for(watch(f"stop-{uuid.uuid4().hex}", "replica-a", occupancy), 30))  # returns at once
    assert not occupancy.stopping


def test_a_ray_started_here_drains_a_stopping_ingress_2_s_not_30_and_a_cluster_keeps_rays_drain(monkeypatch):
    monkeypatch.delenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", raising=False)
    settings = ServiceSettings()
    assert LOCAL_SERVE_ENV == {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
    assert job_env(settings, local=True)["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2"
    assert "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S" not in job_env(settings)
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "10")  # an operator's own wins
    assert job_env(settings, local=True)["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "10"


def test_the_ports_checked_are_those_serve_binds_moved_by_their_variables(monkeypatch):
    settings = ServiceSettings(host="127.0.0.1", port=8123)
    ports = serve_ports(settings)
    assert ports[8123] == ("SEARCH_PORT", "127.0.0.1")
    assert sorted(name for name, _ in ports.values()) == sorted(PORT_VARIABLES)
    assert {name: host for name, host in ports.values()}["RAY_SERVE_HAPROXY_STATS_PORT"] == "0.0.0.0"
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")  # Serve's Python proxy: SEARCH_PORT only
    assert list(serve_ports(settings).values()) == [("SEARCH_PORT", "127.0.0.1")]
