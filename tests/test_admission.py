"""Admission control on a real uvicorn server: past the cap a search is refused at once with 429 and
Retry-After, unless its key is below its fair share of the cap, when it waits for the next place; a queued
request whose client has gone never reaches the model; half-sent heads and bodies and unread answers do not
hold the service; a micro-batch keeps to its token budget."""

from __future__ import annotations

import asyncio
import http.client
import inspect
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from bench.ports import unclaimed_ports
from service.engine.batcher import MicroBatcher
from service.http.app import create_app
from service.http.protocol import timeout_protocol
from tests.test_keys import keys_file
from tests.test_service import call, one, settings_for

READ_TIMEOUT_S = 0.5
WRITE_TIMEOUT_S = 1.0


@contextmanager
def serving(small_index, engine, entered: list | None = None, protocol=HttpToolsProtocol, **overrides):
    """The app on a loopback port, served by uvicorn as `python -m service` serves it; `entered` collects
    the path of every HTTP request that reached the app; `protocol`: the uvicorn protocol extended (h11's
    leaves admission to the app's middleware)."""
    settings = settings_for(small_index, **{"read_timeout_s": READ_TIMEOUT_S, "write_timeout_s": WRITE_TIMEOUT_S,
                                            **overrides})
    app = create_app(settings, engine)

    async def entry(scope, receive, send):
        if scope["type"] == "http" and entered is not None:
            entered.append(scope["path"])
        await app(scope, receive, send)

    port = unclaimed_ports(1)[0]
    server = uvicorn.Server(uvicorn.Config(entry, host="127.0.0.1", port=port, log_level="warning",
                                           http=timeout_protocol(settings.read_timeout_s, settings.write_timeout_s,
                                                                 app.state.occupancy, protocol,
                                                                 max_head_bytes=settings.max_head_bytes,
                                                                 max_headers=settings.max_headers)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started)
        yield app, f"http://127.0.0.1:{port}", port
    finally:
        server.should_exit = True
        thread.join(10)


def wait_until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def send_search(port: int, query: str, path: str = "/search", key: str | None = None) -> socket.socket:
    """A /search (or, with `path` /v1/embeddings, an embeddings request) sent whole on its own
    connection, with `key` as its bearer where given, its answer left unread."""
    body = json.dumps({"query": query, "k": 3} if path == "/search" else {"input": query}).encode()
    authorization = b"Authorization: Bearer %s\r\n" % key.encode() if key else b""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n%s"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), authorization, len(body), body))
    return sock


def metric(base: str, name: str, headers: dict | None = None) -> float:
    for line in httpx.get(f"{base}/metrics", headers=headers, trust_env=False).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@contextmanager
def model_busy(app):
    """Holds the model thread until the block ends, as a long batch would."""
    gate = threading.Event()
    app.state.runtime.executor.submit(gate.wait)
    try:
        yield
    finally:
        gate.set()


def test_past_the_concurrency_cap_a_search_is_refused_at_once_with_retry_after(small_index, engine, demo_queries):
    with serving(small_index, engine, max_concurrent_requests=1) as (app, base, port):
        with model_busy(app):
            first = send_search(port, demo_queries["q0001"])
            wait_until(lambda: app.state.occupancy.in_flight == 1)
            assert metric(base, "search_in_flight_requests") == 1
            # Answered while the model is still held: it was not queued behind it.
            refused = httpx.post(f"{base}/search", json={"query": demo_queries["q0002"]}, trust_env=False)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert "SEARCH_MAX_CONCURRENT_REQUESTS" in refused.json()["detail"]
        first.settimeout(60)
        assert first.recv(64).startswith(b"HTTP/1.1 200")
        first.close()
        assert metric(base, "search_rejected_requests_total") == 1
        wait_until(lambda: app.state.occupancy.in_flight == 0)
        assert httpx.post(f"{base}/search", json={"query": demo_queries["q0002"]}, trust_env=False).status_code == 200


@contextmanager
def access_log_statuses():
    """The statuses uvicorn's access log gives while the block runs (its logger has handlers of its own
    and does not propagate, so it is listened to directly)."""
    statuses: list[str] = []
    listener = logging.Handler()
    listener.emit = lambda record: statuses.append(record.getMessage().rsplit(" ", 1)[1])
    access = logging.getLogger("uvicorn.access")
    level = access.level
    access.setLevel(logging.INFO)
    access.addHandler(listener)
    try:
        yield statuses
    finally:
        access.removeHandler(listener)
        access.setLevel(level)


def test_a_draining_service_answers_the_searches_in_it_and_refuses_new_ones_503_with_retry_after(
        small_index, engine, demo_queries):
    with serving(small_index, engine) as (app, base, port), access_log_statuses() as logged:
        occupancy = app.state.occupancy
        with model_busy(app):
            first = send_search(port, demo_queries["q0001"])
            wait_until(lambda: occupancy.in_flight == 1)
            drained = ThreadPoolExecutor(1).submit(asyncio.run, occupancy.drain(60))
            wait_until(lambda: occupancy.stopping)
            refused = httpx.post(f"{base}/search", json={"query": demo_queries["q0002"]}, trust_env=False)
            assert not drained.done()  # the first search is still in the service
            wait_until(lambda: logged)  # the access log's line, written just after the answer
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["detail"].startswith("stopping: ")
        assert logged[0] == "503"
        first.settimeout(60)
        assert first.recv(64).startswith(b"HTTP/1.1 200")
        first.close()
        assert drained.result(timeout=60) == 0


def test_past_the_cap_the_http_protocol_refuses_before_any_of_the_app_runs(small_index, engine, demo_queries):
    entered = []
    body = json.dumps({"query": demo_queries["q0002"], "k": 3})
    with serving(small_index, engine, entered, max_concurrent_requests=1) as (app, base, port):
        keep_alive = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        with model_busy(app):
            first = send_search(port, demo_queries["q0001"])
            wait_until(lambda: app.state.occupancy.in_flight == 1)
            keep_alive.request("POST", "/search", body, {"Content-Type": "application/json"})
            refused = keep_alive.getresponse()
            assert (refused.status, refused.getheader("retry-after")) == (429, "1")
            assert "SEARCH_MAX_CONCURRENT_REQUESTS" in json.loads(refused.read())["detail"]
            closing = socket.create_connection(("127.0.0.1", port))
            closing.sendall(b"POST /search HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                            % (len(body), body.encode()))
            closing.settimeout(10)
            answer = b""
            while chunk := closing.recv(4096):  # until the server closes the connection
                answer += chunk
            closing.close()
        assert answer.startswith(b"HTTP/1.1 429") and b"\r\nconnection: close\r\n" in answer
        first.settimeout(60)
        assert first.recv(64).startswith(b"HTTP/1.1 200")
        first.close()
        wait_until(lambda: app.state.occupancy.in_flight == 0)
        # The refused request's connection serves the next one (its body was skipped, not read as a request).
        sock = keep_alive.sock
        keep_alive.request("POST", "/search", body, {"Content-Type": "application/json"})
        served = keep_alive.getresponse()
        assert served.status == 200 and json.loads(served.read())["query"] == demo_queries["q0002"]
        assert keep_alive.sock is sock
        keep_alive.close()
        assert metric(base, 'search_http_requests_total{route="/search",status="429"}') == 2
        assert metric(base, "search_rejected_requests_total") == 2
    assert entered.count("/search") == 2  # the first and the last: neither refusal reached the app


def test_requests_without_the_key_take_no_place_under_the_cap(small_index, engine, demo_queries):
    with serving(small_index, engine, max_concurrent_requests=1, api_key="secret") as (app, base, port):
        # Keyless and wrong-key clients whose bodies never finish: the app would answer them 401 only once
        # it had read the bodies, so while they hang on they must not hold the service's one place.
        stalled = []
        for header in (b"", b"Authorization: Bearer wrong\r\n"):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"POST /search HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n" + header +
                         b"Content-Length: 1000\r\n\r\n{")
            stalled.append(sock)
        time.sleep(0.2)  # within READ_TIMEOUT_S: both still hang on
        assert app.state.occupancy.in_flight == 0
        answer = httpx.post(f"{base}/search", json={"query": demo_queries["q0001"]},
                            headers={"Authorization": "bearer  secret"}, trust_env=False)
        assert answer.status_code == 200
        for sock in stalled:
            sock.close()


# Two tenants' keys, and an operator's to read /metrics (it searches nothing, so takes no share).
FAIR_KEYS = {"A": ("a-secret", ["search"], None), "B": ("b-secret", ["search"], None),
             "ops": ("ops-secret", ["admin"], None)}
OPS = {"Authorization": "Bearer ops-secret"}


def search_as(base: str, key: str, query: str) -> httpx.Response:
    return httpx.post(f"{base}/search", json={"query": query, "k": 3}, headers={"Authorization": f"Bearer {key}"},
                      timeout=60, trust_env=False)


def answered(sock: socket.socket) -> bytes:
    """The status line's start of the answer on `sock`, which is then closed."""
    sock.settimeout(60)
    try:
        return sock.recv(64)
    finally:
        sock.close()


@contextmanager
def a_holding_the_cap(small_index, engine, tmp_path, queries, cap: int = 4, **overrides):
    """Key A's searches filling the cap and key B's one search past it, in its place of its own, all held on the
    model thread until `release()`: yields (app, base, port, the sockets of their unread answers, release)."""
    keys = keys_file(tmp_path / "keys.json", FAIR_KEYS)
    with serving(small_index, engine, max_concurrent_requests=cap, api_keys_file=keys, **overrides) as (app, base, port):
        occupancy, gate = app.state.occupancy, threading.Event()
        app.state.runtime.executor.submit(gate.wait)
        try:
            held = [send_search(port, query, key="a-secret") for query in queries[:cap]]
            wait_until(lambda: occupancy.in_flight == cap)
            held.append(send_search(port, queries[cap], key="b-secret"))
            wait_until(lambda: occupancy.held["B"] == 1)
            yield app, base, port, held, gate.set
        finally:
            gate.set()


@pytest.mark.parametrize("protocol", [HttpToolsProtocol, H11Protocol], ids=["protocol", "middleware"])
def test_a_flooding_key_cannot_starve_another_key_of_the_cap(small_index, engine, demo_queries, tmp_path, protocol):
    # Before: with key A's requests filling the cap, every search of key B was answered 429 (issue 75).
    queries = list(demo_queries.values())
    # A Retry-After longer than the test: B's wait for a place ends with one, not with its bound.
    with ThreadPoolExecutor(1) as pool, a_holding_the_cap(small_index, engine, tmp_path, queries, protocol=protocol,
                                                          retry_after_s=60) as (app, base, port, held, release):
        occupancy = app.state.occupancy
        assert occupancy.in_flight == 5  # B's first search is in at once, past the cap, in a place of its own
        b = pool.submit(search_as, base, "b-secret", queries[5])
        wait_until(lambda: b.done() or occupancy.waiting["B"] == 1)
        assert not b.done()  # B's second waits for a place below the cap, below its share (2 keys: 2 each)
        refused = search_as(base, "a-secret", queries[6])  # A, over its share, is refused at once
        assert refused.status_code == 429 and "SEARCH_MAX_CONCURRENT_REQUESTS" in refused.json()["detail"]
        assert metric(base, 'search_key_in_flight_requests{key="A"}', OPS) == 4
        assert metric(base, 'search_key_in_flight_requests{key="B"}', OPS) == 1
        assert metric(base, 'search_key_rejected_requests_total{key="A"}', OPS) == 1
        release()
        assert b.result(60).status_code == 200  # a place below the cap went to B, not to a new arrival
        assert [answered(sock)[:12] for sock in held] == [b"HTTP/1.1 200"] * 5
        wait_until(lambda: occupancy.in_flight == 0)
        assert metric(base, 'search_key_in_flight_requests{key="A"}', OPS) == 0
        assert metric(base, 'search_key_in_flight_requests{key="B"}', OPS) == 0
        assert 'search_key_rejected_requests_total{key="B"}' not in httpx.get(f"{base}/metrics", headers=OPS,
                                                                               trust_env=False).text


def test_without_keys_the_cap_binds_every_search_alike(small_index, engine, demo_queries):
    with serving(small_index, engine, max_concurrent_requests=1) as (app, base, port):
        with model_busy(app):
            held = send_search(port, demo_queries["q0001"])
            wait_until(lambda: app.state.occupancy.in_flight == 1)
            assert httpx.post(f"{base}/search", json={"query": "x"}, trust_env=False).status_code == 429
        assert answered(held).startswith(b"HTTP/1.1 200")


def test_a_search_waiting_for_its_share_is_refused_429_when_no_place_frees_within_the_retry_after(
        small_index, engine, demo_queries, tmp_path):
    queries = list(demo_queries.values())
    with a_holding_the_cap(small_index, engine, tmp_path, queries) as (app, base, port, held, release):
        occupancy = app.state.occupancy
        refused = search_as(base, "b-secret", queries[5])  # the model held past B's wait
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "no place came free within the Retry-After" in refused.json()["detail"]
        assert occupancy.waiting["B"] == 0 and occupancy.in_flight == 5
        release()
        assert [answered(sock)[:12] for sock in held] == [b"HTTP/1.1 200"] * 5
        wait_until(lambda: occupancy.in_flight == 0)
        assert metric(base, 'search_key_rejected_requests_total{key="B"}', OPS) == 1
        assert metric(base, 'search_http_requests_total{route="/search",status="429"}', OPS) == 1
        assert search_as(base, "b-secret", queries[5]).status_code == 200


def test_a_waiting_search_whose_client_has_gone_gives_its_place_back(small_index, engine, demo_queries, tmp_path):
    # A place leaked here would lower the cap for good: every way out of the wait must give it back.
    queries = list(demo_queries.values())
    with a_holding_the_cap(small_index, engine, tmp_path, queries, retry_after_s=60) as (app, base, port, held,
                                                                                         release):
        occupancy = app.state.occupancy
        gone = send_search(port, queries[5], key="b-secret")
        wait_until(lambda: occupancy.waiting["B"] == 1)
        gone.close()
        release()
        assert [answered(sock)[:12] for sock in held] == [b"HTTP/1.1 200"] * 5  # a place went to B's gone client
        wait_until(lambda: occupancy.in_flight == 0)
        assert dict(occupancy.held) == {"A": 0, "B": 0} and not occupancy.waiters
        with model_busy(app):  # the whole cap is there again: a draining service answers a waiting search 503
            held = [send_search(port, query, key="a-secret") for query in queries[:4]]
            held.append(send_search(port, queries[4], key="b-secret"))
            wait_until(lambda: occupancy.in_flight == 5)
            waiting = send_search(port, queries[5], key="b-secret")
            wait_until(lambda: occupancy.waiting["B"] == 1)
            server_loop = occupancy.waiters[0].granted.get_loop()  # where the stop's drain runs
            drained = asyncio.run_coroutine_threadsafe(occupancy.drain(60), server_loop)
            assert answered(waiting).startswith(b"HTTP/1.1 503")
        assert [answered(sock)[:12] for sock in held] == [b"HTTP/1.1 200"] * 5
        assert drained.result(timeout=60) == 0
        assert dict(occupancy.held) == {"A": 0, "B": 0} and not occupancy.waiters


def statuses_read(stream, count: int) -> list[int]:
    """The statuses of the next `count` answers on `stream` (a socket's file), each read whole."""
    statuses = []
    for _ in range(count):
        statuses.append(int(stream.readline().split()[1]))
        length = 0
        while (line := stream.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            length = int(value) if name.strip().lower() == b"content-length" else length
        stream.read(length)
    return statuses


def test_pipelined_searches_are_admitted_once_the_one_before_has_left(small_index, engine, demo_queries):
    body = json.dumps({"query": demo_queries["q0001"], "k": 3}).encode()
    search = b"POST /search HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body), body)
    with serving(small_index, engine, max_concurrent_requests=1) as (app, base, port):
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(search * 3)  # one at a time in the service: never over the cap of 1
            assert statuses_read(sock.makefile("rb"), 3) == [200, 200, 200]
        with model_busy(app):
            first = send_search(port, demo_queries["q0002"])
            wait_until(lambda: app.state.occupancy.in_flight == 1)
            with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
                # Each refused in turn on the connection that sent them; a HEAD is no search (405, no body).
                sock.sendall(search * 300 + b"HEAD /search HTTP/1.1\r\nHost: t\r\n\r\n")
                stream = sock.makefile("rb")
                assert statuses_read(stream, 300) == [429] * 300
                assert stream.readline().startswith(b"HTTP/1.1 405")
        first.close()


@pytest.mark.parametrize("path", ["/search", "/v1/embeddings"])
def test_a_queued_request_whose_client_has_gone_never_reaches_the_model(small_index, engine, demo_queries, path):
    with serving(small_index, engine) as (app, base, port):
        runtime = app.state.runtime
        with model_busy(app):
            running = send_search(port, demo_queries["q0001"], path)  # taken by the batcher, waits for the model
            wait_until(lambda: app.state.occupancy.in_flight == 1 and runtime.batcher.waiting == 0)
            gone = send_search(port, demo_queries["q0002"], path)  # queued behind it
            wait_until(lambda: runtime.batcher.waiting == 1)
            assert metric(base, "search_queue_size") == 1
            gone.close()
            wait_until(lambda: app.state.occupancy.in_flight == 1)  # its route has given up on it
        running.settimeout(60)
        assert running.recv(64).startswith(b"HTTP/1.1 200")
        running.close()
        wait_until(lambda: runtime.batcher.waiting == 0)
        assert metric(base, "search_dropped_requests_total") == 1
        assert metric(base, "search_batch_size_count") == 1  # one forward pass: the request still wanted


def test_a_half_sent_request_head_is_closed_after_the_read_timeout(small_index, engine):
    with serving(small_index, engine) as (app, base, port):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /search HTTP/1.1\r\nHost: t\r\n")  # the head never ends
        sock.settimeout(10 * READ_TIMEOUT_S)  # a hang would raise here
        assert sock.recv(64) == b""  # closed by the server
        sock.close()
        assert httpx.get(f"{base}/health", trust_env=False).status_code == 200


def test_a_half_sent_body_is_answered_408_after_the_read_timeout(small_index, engine):
    with serving(small_index, engine) as (app, base, port):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /search HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"query\": ")
        sock.settimeout(10 * READ_TIMEOUT_S)
        answer = sock.recv(4096)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 408")
        assert b"SEARCH_READ_TIMEOUT_S" in answer


def test_an_unread_answer_is_dropped_after_the_write_timeout(small_index, engine, demo_queries):
    # A batch answer of several MB (every hit carries its passage) to a client that never reads it.
    body = json.dumps({"queries": [demo_queries["q0001"]] * 64, "k": 1000}).encode()
    with serving(small_index, engine, max_k=1000) as (app, base, port):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /search/batch HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: app.state.occupancy.in_flight == 0, 60)  # handed to the server to send
        time.sleep(3 * WRITE_TIMEOUT_S)  # the client reads nothing for longer than the write timeout
        head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200")
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        assert length > 4_000_000  # more than the kernel's buffers hold: the rest had to wait in the server
        received = len(head.split(b"\r\n\r\n", 1)[1])
        sock.settimeout(10)
        try:
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            pass
        sock.close()
        assert received < length  # the answer was cut off, not kept for a reader that never came
        assert httpx.get(f"{base}/health", trust_env=False).status_code == 200


def test_a_micro_batch_keeps_to_its_token_budget(engine):
    sizes: list[int] = []
    gate = threading.Event()
    encoder = engine.searcher.encoder
    six, three = encoder.tokenize("apple apple apple apple"), encoder.tokenize("apple")
    assert (len(six.ids), len(three.ids)) == (6, 3)  # [CLS] and [SEP] included

    def held(queries, plan, tokens):
        gate.wait()
        return engine.run(queries, plan, tokens)

    async def scenario():
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = MicroBatcher(held, executor, 0.0, max_batch=8, on_batch=sizes.append, max_tokens=10)
            first = asyncio.create_task(batcher.search("apple apple apple apple", engine.plan(3), tokens=six))
            await asyncio.sleep(0.05)  # on the model
            queued = [asyncio.create_task(batcher.search(text, engine.plan(3), tokens=tokens))
                      for text, tokens in (("apple apple apple apple", six),) * 2 + (("apple", three),)]
            await asyncio.sleep(0.05)
            gate.set()
            await asyncio.wait_for(asyncio.gather(first, *queued), timeout=60)
            await batcher.close()

    asyncio.run(scenario())
    assert sizes == [1, 1, 2]  # 6 | 6 (6 + 6 > 10) | 6 + 3


def test_a_search_batch_over_the_token_budget_is_a_422_naming_the_limit(small_index, engine, demo_queries):
    app = create_app(settings_for(small_index, max_batch_tokens=20), engine)
    queries = [demo_queries[q] for q in ("q0001", "q0002", "q0003", "q0004")]
    response = one(app, "POST", "/search/batch", {"queries": queries, "k": 3})
    assert response.status_code == 422
    problem = response.json()["detail"][0]
    assert problem["loc"] == ["body", "queries"]
    assert "over the max_batch_tokens limit of 20 (SEARCH_MAX_BATCH_TOKENS)" in problem["msg"]
    assert one(app, "POST", "/search/batch", {"queries": queries[:1], "k": 3}).status_code == 200


@pytest.mark.parametrize("key", [None, "k3y"])
def test_the_spec_declares_every_refusal_a_search_may_get(small_index, engine, key):
    app = create_app(settings_for(small_index, api_key=key), engine)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    spec = call(app, ("GET", "/openapi.json", None), headers=headers)[0].json()
    for path in ("/search", "/search/batch"):
        declared = set(spec["paths"][path]["post"]["responses"])
        assert {"200", "400", "408", "422", "429", "503"} <= declared
        assert ("401" in declared) == (key is not None)


@pytest.mark.parametrize("path", ["/search", "/search/batch"])
def test_latency_counts_the_wait_for_the_model_thread_on_paths_that_do_not_micro_batch(small_index, engine,
                                                                                      demo_queries, path):
    with serving(small_index, engine, microbatch=False) as (app, base, port):
        gate, holding = threading.Event(), threading.Event()
        executor = app.state.runtime.executor
        executor.submit(lambda: (holding.set(), gate.wait()))  # other work holds the model thread
        # Until the thread has taken that work, it is the one in the queue: the search must be.
        assert holding.wait(60)
        query = demo_queries["q0001"]
        body = {"query": query} if path == "/search" else {"queries": [query]}
        answers = []
        asking = threading.Thread(target=lambda: answers.append(httpx.post(base + path, json=body, trust_env=False,
                                                                           timeout=60)))
        asking.start()
        wait_until(lambda: executor.waiting == 1)  # the search waits for the thread
        time.sleep(0.3)
        gate.set()
        asking.join(60)
        latency = answers[0].json()["latency_ms"]
        assert latency["queue"] >= 300
        # Each figure is rounded to the microsecond on its own: the sum may pass the total by a few.
        assert latency["total"] >= latency["queue"] + latency["encode"] + latency["retrieve"] - 0.002


def test_the_uvicorn_hooks_the_protocol_extends_are_there_with_the_arguments_it_passes():
    # service/http/protocol.py overrides private methods of uvicorn's protocol; pyproject.toml pins uvicorn to the
    # versions tested. A uvicorn that renames or reshapes one fails here by name, not as a silent bypass.
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    expected = {"_start_asgi_task": ["self", "cycle", "app"], "on_message_begin": ["self"],
                "on_header": ["self", "name", "value"], "on_headers_complete": ["self"],
                "on_response_complete": ["self"], "data_received": ["self", "data"], "pause_writing": ["self"],
                "resume_writing": ["self"], "connection_made": ["self", "transport"],
                "connection_lost": ["self", "exc"]}
    for name, parameters in expected.items():
        assert list(inspect.signature(getattr(HttpToolsProtocol, name)).parameters) == parameters, name
