"""What a hostile client can still take from `python -m service` (issue 34's findings, measured):

    python bench/hardening.py [--index indexes/demo] [--device cpu] [--heads 20] [--head-mib 100]
                              [--unread 150] [--cap 64] [--rerank-texts 1000] [--rerank-tokens 520]

1. head flood: `--heads` connections each sending up to `--head-mib` MiB of one header line to
   /health, all held open: the server's RSS before, at its highest (sampled every 50 ms) and after.
2. unread answers: `--unread` clients, one after another, each sending a /search/batch of 64 queries
   at k=1000 (hybrid) and reading nothing once its answer has begun, against
   SEARCH_MAX_CONCURRENT_REQUESTS=--cap (SEARCH_WRITE_TIMEOUT_S 600, past the run): how many were
   answered 200 and 429, and the server's RSS before and with every answer unread.
3. rerank stall: a monoBERT with the packaged MiniLM's weights (a random head: its cost is real, its
   scores meaningless); one /rerank of `--rerank-texts` texts of about `--rerank-tokens` tokens, with
   SEARCH_MAX_RERANK_TOKENS raised to let it in, while one client searches in a loop: the rerank's
   time and the worst /search latency during it. Then the same /rerank at the default budget: its status.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import QUERIES, Server, rss_mib  # noqa: E402


def sampled_peak(pid: int, stop: threading.Event, peak: list[float]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], rss_mib(pid))
        time.sleep(0.05)


def head_flood(server: Server, connections: int, mib: int) -> dict:
    pid = server.process.pid
    before, peak, stop = rss_mib(pid), [0.0], threading.Event()
    watcher = threading.Thread(target=sampled_peak, args=(pid, stop, peak))
    watcher.start()
    chunk, held, refused = b"a" * 65536, [], 0
    started = time.perf_counter()
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\nX-Pad: ")
        try:
            for _ in range(mib * 16):
                sock.sendall(chunk)
        except OSError:
            refused += 1
        held.append(sock)
    seconds = time.perf_counter() - started
    time.sleep(0.5)
    stop.set()
    watcher.join()
    during = rss_mib(pid)
    for sock in held:
        sock.close()
    time.sleep(0.5)
    return {"rss_before_mib": round(before), "rss_peak_mib": round(peak[0]), "rss_held_mib": round(during),
            "rss_after_mib": round(rss_mib(pid)), "refused_connections": refused, "seconds": round(seconds, 2),
            "health_after": httpx.get(f"{server.base}/health", trust_env=False).status_code}


def unread_answers(server: Server, clients: int) -> dict:
    pid = server.process.pid
    body = json.dumps({"queries": QUERIES[:64], "k": 1000, "mode": "hybrid"}).encode()
    request = (b"POST /search/batch HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    before, socks, statuses = rss_mib(pid), [], []
    for _ in range(clients):  # one after another, each once its answer has begun
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(request)
        sock.settimeout(120)
        statuses.append(sock.recv(12, socket.MSG_PEEK)[9:12].decode())
        socks.append(sock)
    time.sleep(2)
    held = rss_mib(pid)
    for sock in socks:
        sock.close()
    return {"rss_before_mib": round(before), "rss_unread_mib": round(held),
            "answered_429": statuses.count("429"), "answered_200": statuses.count("200")}


def monobert_from_minilm(folder: Path) -> Path:
    from transformers import BertForSequenceClassification, BertTokenizerFast

    from models.encoder import default_model_path

    BertForSequenceClassification.from_pretrained(default_model_path(), num_labels=2).save_pretrained(folder)
    BertTokenizerFast.from_pretrained(default_model_path()).save_pretrained(folder)
    return folder


def rerank_stall(server: Server, texts: list[str]) -> dict:
    latencies, stop = [], threading.Event()

    def search_loop():
        with httpx.Client(trust_env=False, timeout=600) as client:
            n = 0
            while not stop.is_set():
                started = time.perf_counter()
                client.post(f"{server.base}/search", json={"query": QUERIES[n % len(QUERIES)]})
                latencies.append(1000 * (time.perf_counter() - started))
                n += 1

    searcher = threading.Thread(target=search_loop)
    searcher.start()
    time.sleep(1)
    latencies.clear()
    started = time.perf_counter()
    answer = httpx.post(f"{server.base}/rerank", json={"query": "what does a path join do", "texts": texts},
                        timeout=3600, trust_env=False)
    seconds = time.perf_counter() - started
    stop.set()
    searcher.join()
    return {"rerank_status": answer.status_code, "rerank_s": round(seconds, 1), "searches_during": len(latencies),
            "search_worst_ms": round(max(latencies), 1) if latencies else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=Path, default=Path("indexes/demo"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--head-mib", type=int, default=100)
    parser.add_argument("--unread", type=int, default=150)
    parser.add_argument("--cap", type=int, default=64)
    parser.add_argument("--rerank-texts", type=int, default=1000)
    parser.add_argument("--rerank-tokens", type=int, default=520)
    parser.add_argument("--skip", nargs="*", default=[], choices=["heads", "unread", "rerank"])
    args = parser.parse_args()
    if "heads" not in args.skip:
        with Server(args.index, args.device) as server:
            print("head flood:", head_flood(server, args.heads, args.head_mib), flush=True)
    if "unread" not in args.skip:
        # A write timeout longer than the run: what unread answers pin before it frees them.
        with Server(args.index, args.device, max_concurrent_requests=str(args.cap), write_timeout_s="600") as server:
            print("unread answers:", unread_answers(server, args.unread), flush=True)
    if "rerank" not in args.skip:
        text = " ".join(["the join of two paths"] * (args.rerank_tokens // 5))  # about 5 tokens a phrase
        texts = [f"{i} {text}" for i in range(args.rerank_texts)]
        with tempfile.TemporaryDirectory() as folder:
            reranker = monobert_from_minilm(Path(folder) / "monobert-minilm")
            with Server(args.index, args.device, rerankers=json.dumps([str(reranker)]),
                        max_rerank_tokens=str(10**9)) as server:
                print("rerank stall:", rerank_stall(server, texts), flush=True)
            with Server(args.index, args.device, rerankers=json.dumps([str(reranker)])) as server:
                refused = httpx.post(f"{server.base}/rerank", json={"query": "join", "texts": texts}, timeout=600,
                                     trust_env=False)
                print("at the default budget:", refused.status_code, refused.text[:300], flush=True)


if __name__ == "__main__":
    main()
