"""No request may take the service's memory or its model thread: request heads, reranks and unread
answers are bounded, and the smaller edges (HEAD probes, `dimensions`, the page's files, a stop with a
silent trace collector) answer as a client expects. Each case was seen failing before it was mended."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import numpy as np

from service.engine.search_engine import SearchEngine
from service.engine.tracing import Tracing, otlp_provider
from service.http.app import create_app
from tests.test_admission import serving, wait_until
from tests.test_rerank_service import small_cross_encoder  # noqa: F401 - the session fixture
from tests.test_service import one, settings_for

MIB = 1 << 20


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def answer_of(sock: socket.socket) -> bytes:
    """What the server wrote before it closed (a reset after its answer counts as its end)."""
    sock.settimeout(30)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def test_a_request_head_over_the_byte_limit_is_answered_431_and_the_connection_closed(small_index, engine):
    with serving(small_index, engine) as (app, base, port):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * 40_000 + b"\r\n\r\n")
        answer = answer_of(sock)
        assert answer.startswith(b"HTTP/1.1 431 ")
        assert b"SEARCH_MAX_HEAD_BYTES" in answer and b"connection: close" in answer
        assert httpx.get(f"{base}/health", trust_env=False).status_code == 200


def test_a_request_with_too_many_header_lines_is_answered_431(small_index, engine):
    with serving(small_index, engine, max_headers=50) as (app, base, port):
        sock = socket.create_connection(("127.0.0.1", port))
        lines = b"".join(b"X-H%d: v\r\n" % i for i in range(60))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n" + lines + b"\r\n")
        answer = answer_of(sock)
        assert answer.startswith(b"HTTP/1.1 431 ") and b"max_headers limit of 50" in answer
        sock = socket.create_connection(("127.0.0.1", port))  # at the limit (50 lines), answered as usual
        lines = b"".join(b"X-H%d: v\r\n" % i for i in range(48))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n" + lines + b"\r\n")
        assert answer_of(sock).startswith(b"HTTP/1.1 200 ")


def test_a_small_head_before_a_large_body_is_not_taken_for_a_large_head(small_index, engine):
    with serving(small_index, engine) as (app, base, port):
        body = json.dumps({"query": "x" * 30_000}).encode()  # head and body in one write, past the head limit
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /search HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        answer = answer_of(sock)
        assert answer.startswith(b"HTTP/1.1 422 ") and b"SEARCH_MAX_QUERY_CHARS" in answer


def test_a_flood_of_endless_request_heads_does_not_grow_the_server(small_index, engine):
    # Before: each connection's head was kept whole by the parser (20 x 100 MB took 1.1 GiB).
    chunk = b"a" * 65536
    with serving(small_index, engine) as (app, base, port):
        before = rss_mib()
        flood = []
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Pad: ")
            sent = 0
            try:
                while sent < 16 * MIB:
                    sock.sendall(chunk)
                    sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            flood.append((sock, sent))
        grown = rss_mib() - before
        assert all(sent < 16 * MIB for _, sent in flood), "the server kept reading an endless head"
        assert grown < 32, f"RSS grew by {grown:.0f} MiB under 8 endless heads"
        for sock, _ in flood:
            sock.close()
        assert httpx.get(f"{base}/health", trust_env=False).status_code == 200


def test_health_and_ready_answer_head_as_they_answer_get(small_index, engine):
    app = create_app(settings_for(small_index), engine)
    for path in ("/health", "/ready"):
        response = one(app, "HEAD", path)
        assert response.status_code == 200 and response.content == b""


def test_embeddings_refuse_a_dimensions_other_than_the_encoders(small_index, engine):
    app = create_app(settings_for(small_index), engine)
    dimension = engine.searcher.manifest.dimension
    refused = one(app, "POST", "/v1/embeddings", {"input": "wing", "dimensions": 64})
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "dimensions"]
    assert str(dimension) in refused.json()["detail"][0]["msg"]
    served = one(app, "POST", "/v1/embeddings", {"input": "wing", "dimensions": dimension})
    assert served.status_code == 200 and len(served.json()["data"][0]["embedding"]) == dimension


def test_the_page_is_served_once_with_its_security_headers_and_its_files_carry_them(small_index, engine):
    app = create_app(settings_for(small_index), engine)
    assert one(app, "GET", "/static/index.html").status_code == 404  # no copy without its headers
    page = one(app, "GET", "/")
    assert "{{KEY_REQUIRED}}" not in page.text and "frame-ancestors 'none'" in page.headers["content-security-policy"]
    script = one(app, "GET", "/static/search.js")
    assert script.status_code == 200 and "frame-ancestors 'none'" in script.headers["content-security-policy"]


def test_an_unread_answer_keeps_its_request_counted_against_the_cap(small_index, engine, demo_queries):
    # Before: the answer went whole into the send buffer and its request left the service at once, so
    # clients that never read could pin any number of answers.
    queries = [demo_queries[f"q{n:04d}"] for n in range(1, 65)]
    body = json.dumps({"queries": queries, "k": 300, "mode": "hybrid"}).encode()
    with serving(small_index, engine, max_concurrent_requests=1, write_timeout_s=60) as (app, base, port):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # reads nothing, holds little
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /search/batch HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        occupancy = app.state.occupancy
        wait_until(lambda: occupancy.in_flight == 1)
        sock.settimeout(60)
        assert sock.recv(1, socket.MSG_PEEK)  # its answer is being written, and is not read
        refused = httpx.post(f"{base}/search", json={"query": queries[0]}, trust_env=False)
        assert refused.status_code == 429 and occupancy.in_flight == 1
        sock.settimeout(60)
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(65536)
        head, rest = received.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += sock.recv(1 << 20)
        assert len(json.loads(rest)["results"]) == 64  # read at last, it is whole
        sock.close()
        wait_until(lambda: occupancy.in_flight == 0)


def test_rerank_over_the_token_budget_is_a_422_naming_the_limit(small_index, searcher, small_cross_encoder):
    engine = SearchEngine(searcher, {"monobert": small_cross_encoder})
    app = create_app(settings_for(small_index, rerankers=[small_cross_encoder.path], max_rerank_tokens=500), engine)
    texts = ["the flow over a swept wing at high speed " * 12] * 10  # about 100 tokens each with the query
    refused = one(app, "POST", "/rerank", {"query": "wing", "texts": texts})
    assert refused.status_code == 422
    problem = refused.json()["detail"][0]
    assert problem["loc"] == ["body", "texts"] and "SEARCH_MAX_RERANK_TOKENS" in problem["msg"]
    assert one(app, "POST", "/rerank", {"query": "wing", "texts": texts[:3]}).status_code == 200


def test_searches_are_answered_between_the_slices_of_a_long_rerank(small_index, searcher, small_cross_encoder,
                                                                   demo_queries):
    # Before: one /rerank held the model thread whole (1,000 long texts on monoBERT: 47.6 s), and every
    # search waited behind it.
    engine = SearchEngine(searcher, {"monobert": small_cross_encoder})
    # 400 texts of 512 tokens: 25 slices, time for several searches between them
    texts = [f"passage {i}: " + "the boundary layer of a swept wing thickens downstream " * 60 for i in range(400)]
    done: dict[str, float] = {}
    with serving(small_index, engine, rerankers=[small_cross_encoder.path], max_rerank_depth=1000,
                 max_rerank_tokens=1_000_000, write_timeout_s=60) as (app, base, port):
        def rerank():
            done["rerank_answer"] = httpx.post(f"{base}/rerank", json={"query": "wing", "texts": texts},
                                               timeout=300, trust_env=False)
            done["rerank"] = time.monotonic()

        thread = threading.Thread(target=rerank)
        started = time.monotonic()
        thread.start()
        wait_until(lambda: app.state.occupancy.in_flight == 1)
        searches = []
        while thread.is_alive():  # searches one after another for as long as the rerank runs
            query = demo_queries[f"q{len(searches) % 50 + 1:04d}"]
            searches.append(httpx.post(f"{base}/search", json={"query": query}, timeout=300, trust_env=False))
            searches[-1].finished = time.monotonic()
        thread.join(300)
    assert {s.status_code for s in searches} == {200}
    # The rerank counts its texts' tokens before its slices reach the model thread (about a fifth of its
    # time): searches answered in its second half were answered between slices.
    halfway = (started + done["rerank"]) / 2
    between = sum(halfway < s.finished < done["rerank"] for s in searches)
    assert between >= 3, f"{between} searches answered in the rerank's second half: they waited for all of it"
    answer = done["rerank_answer"].json()["results"]
    scores = {item["index"]: item["relevance_score"] for item in answer}
    np.testing.assert_allclose([scores[i] for i in range(len(texts))], small_cross_encoder.score("wing", texts),
                               atol=1e-5)  # sliced, scored as in one go


def test_a_stop_waits_a_bounded_time_for_a_trace_collector_that_never_answers():
    # Before: SIGTERM took 30.3 s to exit with such a collector, past a 30 s grace period.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts (the kernel's backlog) and never answers
    tracing = Tracing(otlp_provider(f"http://127.0.0.1:{silent.getsockname()[1]}", "test"), owned=True)
    tracing.provider.get_tracer("test").start_span("a request").end()  # one span left to export
    stopped = threading.Thread(target=tracing.shutdown, daemon=True)
    stopped.start()
    stopped.join(8)  # the exporter's own timeout is 10 s, its retries more
    assert not stopped.is_alive(), "the stop waited for the collector"
    silent.close()
