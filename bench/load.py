"""HTTP load on 127.0.0.1: micro-batching on against off, and HTTP against in-process latency.

    python bench/load.py [--index indexes/demo] [--clients 32] [--seconds 30] [--slices 6] [--device cpu]

Starts `python -m service` twice on free loopback ports (SEARCH_MICROBATCH=true and false) and
drives them in turn, in `--slices` alternating slices (on, off, off, on, ...) that add up to
`--seconds` each, with `--clients` concurrent httpx clients (bounded: every client stops at the
slice's deadline); prints throughput, p50/p99 and errors with the on/off ratio. Alternating slices
let a shared host whose speed drifts weigh on both sides alike.
Then, one request at a time, compares the HTTP round trip (micro-batching on and off; httpx,
and the standard library's client to show the client's own share) with `SearchEngine.search`
in this process for the same queries. Builds the demo index first if `--index` does not exist.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from dataclasses import dataclass, field
from http.client import HTTPConnection
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ports import unclaimed_ports  # noqa: E402
from index_builder.build import BuildOptions, build_index  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402
from retrieval.load_options import LoadOptions  # noqa: E402
from service.engine.search_engine import SearchEngine  # noqa: E402

QUERIES = [line.split("\t", 1)[1].strip() for line in (ROOT / "data/demo/queries.tsv").read_text().splitlines()]


class Process:
    """A server process on a loopback port, ready once `ready_path` answers 200, stopped on exit."""

    ready_path = "/ready"
    startup_s = 120

    def __init__(self, command: list[str], env: dict[str, str], port: int, cwd: Path = ROOT) -> None:
        """`cwd`: the checkout whose code runs (another than this one to measure it against this)."""
        self.port = port
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self):
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base}{self.ready_path}", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace")[-3000:]
        self.__exit__()
        raise RuntimeError(f"{type(self).__name__} did not become ready in {self.startup_s} s; its output ended:\n{tail}")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def name_value(text: str) -> tuple[str, str]:
    """An argparse type for NAME=VALUE options (a variable for one process's environment)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"takes NAME=VALUE, got {text!r}")
    return name, value


class Server(Process):
    """`python -m service` on a loopback port, stopped on exit."""

    def __init__(self, index: Path, device: str, environ: dict[str, str] | None = None, checkout: Path = ROOT,
                 **env: str) -> None:
        """`env`: SEARCH_* settings by their lower-case names; `environ`: other variables, as named; `checkout`:
        whose code serves (another checkout, with this one's virtual environment)."""
        [port] = unclaimed_ports(1)
        variables = {**os.environ, **(environ or {}), "SEARCH_INDEX_DIR": str(index), "SEARCH_PORT": str(port),
                     "SEARCH_DEVICE": device}
        if checkout != ROOT:
            variables["PYTHONPATH"] = str(checkout)
        variables.update({f"SEARCH_{k.upper()}": v for k, v in env.items()})
        super().__init__([sys.executable, "-m", "service"], variables, port, cwd=checkout)


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 client connection, as an asyncio protocol that parses only the status line,
    Content-Length and Retry-After of each answer. Load clients share a small host's cores with the
    server they measure, and every microsecond they spend is taken from it (and, in a wave of 1,000
    requests, delays the next answer's clock): httpx costs about a core for a thousand clients, asyncio
    streams about 60 us a request, this about half of that."""

    def __init__(self, host: str, port: int | str, timeout_s: float | None = None, key: str | None = None) -> None:
        """`key`: an API key sent as the bearer of every request."""
        self.host, self.port, self.timeout_s = host, int(port), timeout_s
        self.authorization = f"Authorization: Bearer {key}\r\n" if key else ""
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None or self.waiter.done():
            return
        head = bytes(self.buffer[:end]).lower()
        length = int(self._field(head, b"content-length") or 0)
        if len(self.buffer) < end + 4 + length:
            return
        del self.buffer[:end + 4 + length]
        self.waiter.set_result((int(head[9:12]), float(self._field(head, b"retry-after") or 0)))

    @staticmethod
    def _field(head: bytes, name: bytes) -> bytes | None:
        """The value of header `name` in a lower-cased answer head; None where it is absent."""
        at = head.find(b"\r\n" + name + b":")
        if at < 0:
            return None
        end = head.find(b"\r\n", at + 2)
        return head[at + len(name) + 3:end if end >= 0 else len(head)].strip()

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionResetError("the server closed the connection"))

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, float]:
        """Sends one request, waits for its whole answer: its status and Retry-After seconds (0 without one).
        Reconnects when the connection was closed."""
        loop = asyncio.get_running_loop()
        if self.transport is None or self.transport.is_closing():
            self.buffer.clear()
            await loop.create_connection(lambda: self, self.host, self.port)
        self.waiter = loop.create_future()
        self.transport.write((f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                              f"{self.authorization}Content-Length: {len(body)}\r\n\r\n").encode() + body)
        try:
            return await asyncio.wait_for(self.waiter, self.timeout_s)
        except TimeoutError:  # an OSError: counted as a failure; the late answer must not be read as the next
            self.close()
            raise

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    async def aclose(self) -> None:  # as httpx.AsyncClient's, so a pool of either closes alike
        self.close()


@dataclass
class Load:
    """What one server answered under load, summed over slices."""

    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    slice_rps: list[float] = field(default_factory=list)
    client_cpu: float = 0.0  # CPU seconds of this process (the httpx clients) while loading
    server_cpu: float | None = 0.0  # and of the server process; None where /proc is absent
    mean_batch: float = 1.0  # requests per forward pass

    def row(self) -> dict:
        p50, p99 = np.percentile(self.latencies, [50, 99]) if self.latencies else (float("nan"), float("nan"))
        rps = len(self.latencies) / self.seconds
        return {"requests": len(self.latencies), "rps": rps, "p50": p50, "p99": p99, "errors": self.errors}


Request = Callable[[int], tuple[str, dict]]  # a pool's i-th request: (route, JSON body)


def search_request(k: int) -> Request:
    """The pool's i-th /search request: demo query i at `k`."""
    return lambda i: ("/search", {"query": QUERIES[i % len(QUERIES)], "k": k})


async def posted(client: httpx.AsyncClient | Connection, path: str, body: dict) -> bool:
    """Whether `client` got 200 for `body` posted to `path` (False on a transport error)."""
    try:
        if isinstance(client, Connection):
            return (await client.request("POST", path, json.dumps(body).encode()))[0] == 200
        return (await client.post(path, json=body)).status_code == 200
    except (httpx.HTTPError, OSError):
        return False


async def drive(pool: list[httpx.AsyncClient | Connection], seconds: float, into: Load, request: Request) -> None:
    """Each client of `pool` posts `request(i)` (route, JSON body), one after another, for `seconds`,
    i counting the pool's requests (client n sends n, n + len(pool), ...); answers and errors go `into`.
    The clients exist and are connected before the clock starts (`alternate` warms them up): opening 32
    of them inside the timed window puts their set-up (~0.5 s on two cores) into the first requests'
    latency, which was most of the p99."""
    deadline = time.perf_counter() + seconds
    before = len(into.latencies)

    async def client(number: int, http: httpx.AsyncClient) -> None:
        i = number
        while time.perf_counter() < deadline:
            path, body = request(i)
            started = time.perf_counter()
            if await posted(http, path, body):
                into.latencies.append(1000 * (time.perf_counter() - started))
            else:
                into.errors += 1
            i += len(pool)

    started = time.perf_counter()
    await asyncio.gather(*(client(number, http) for number, http in enumerate(pool)))
    elapsed = time.perf_counter() - started
    into.seconds += elapsed
    into.slice_rps.append((len(into.latencies) - before) / elapsed)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far, all threads (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` so far, in MiB (Linux /proc); NaN where it has none or is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return float("nan")
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith("VmRSS:")), float("nan"))


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (the load's clients), on any platform."""
    times = os.times()
    return times.user + times.system


def throughput(index: Path, device: str, clients: int, seconds: float, slices: int, k: int) -> dict[str, Load]:
    """Both servers up at once, loaded in turn: on, off, off, on, on, off, ... (a drift that is
    linear in time weighs on both alike), `seconds / slices` per slice, after a 2 s warm-up each.
    The batching server's mean batch size (warm-up included) comes back in its `mean_batch`."""
    with Server(index, device, microbatch="true") as on, Server(index, device, microbatch="false") as off:
        servers = {"micro-batching on": on, "micro-batching off": off}
        results = asyncio.run(alternate({label: (server.base, search_request(k)) for label, server in servers.items()},
                                        clients, seconds, slices, timeout_s=30.0,
                                        pids={label: server.process.pid for label, server in servers.items()}))
        results["micro-batching on"].mean_batch = mean_batch(on.base)
    return results


async def alternate(targets: dict[str, tuple[str, Request]], clients: int, seconds: float, slices: int,
                    warm_up_s: float = 2.0, timeout_s: float = 120.0,
                    pids: dict[str, int] | None = None, light: bool = False,
                    after_slice: Callable[[str], None] | None = None) -> dict[str, Load]:
    """targets: label -> (base URL, request); each loaded in turn by its own `clients` httpx clients
    (`light`: `Connection`s, which leave the servers more of a small host's CPU), in `slices`
    alternating slices (first, second, second, first, ...) adding up to `seconds`, after a warm-up that
    also opens every connection. Each Load also gets the CPU this process (the clients) used, and the
    server's where `pids` gives its process (label -> pid). `after_slice(label)` is called after each slice."""
    results = {label: Load() for label in targets}
    pools = {label: [Connection(*base.removeprefix("http://").split(":"), timeout_s=timeout_s) if light else
                     httpx.AsyncClient(base_url=base, timeout=timeout_s, trust_env=False) for _ in range(clients)]
             for label, (base, _) in targets.items()}
    try:
        for label, (_, request) in targets.items():
            await drive(pools[label], warm_up_s, Load(), request)
        for number in range(slices):
            for label in (list(targets) if number % 2 == 0 else list(reversed(targets))):
                result, pid = results[label], (pids or {}).get(label)
                client_before, server_before = own_cpu_seconds(), cpu_seconds(pid) if pid else None
                await drive(pools[label], seconds / slices, result, targets[label][1])
                client_after, server_after = own_cpu_seconds(), cpu_seconds(pid) if pid else None
                result.client_cpu += client_after - client_before
                if result.server_cpu is not None and server_before is not None and server_after is not None:
                    result.server_cpu += server_after - server_before
                else:
                    result.server_cpu = None
                if after_slice is not None:
                    after_slice(label)
    finally:
        for pool in pools.values():
            await asyncio.gather(*(http.aclose() for http in pool))
    return results


def timed(call, items) -> list[float]:
    """Milliseconds of `call(item)` for each item."""
    times = []
    for item in items:
        started = time.perf_counter()
        call(item)
        times.append(1000 * (time.perf_counter() - started))
    return times


def timed_ms(call, items) -> float:
    """p50 milliseconds of `call(item)` over the items, after a warm-up on the first five."""
    for item in items[:5]:
        call(item)
    return statistics.median(timed(call, items))


def http_vs_engine(index: Path, device: str, engine: SearchEngine, rounds: int, k: int, blocks: int = 10) -> dict[str, float]:
    """p50 ms of one request at a time: the HTTP round trip with micro-batching on (the default)
    and off, the server's own engine time for those requests, the same request through the
    standard library's http.client (what the httpx client itself costs), HTTP round trips that
    do no work (/health), and the engine in this process. All are timed in alternating blocks of
    the same queries, so a machine whose speed drifts (a shared host) weighs on them alike."""
    queries = QUERIES[:rounds]
    server_ms: list[float] = []  # the batching-off server's own engine time (on, it would include queueing)

    def post(http, query, server_times=None):
        response = http.post("/search", json={"query": query, "k": k})
        response.raise_for_status()
        total = response.json()["latency_ms"]["total"]
        if server_times is not None:
            server_times.append(total)

    def post_stdlib(connection, query):
        body = json.dumps({"query": query, "k": k})
        connection.request("POST", "/search", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
        if response.status != 200:
            raise RuntimeError(f"/search answered {response.status}: {payload[:200]!r}")
        json.loads(payload)

    def get_stdlib(connection, path):
        connection.request("GET", path)
        connection.getresponse().read()

    with (Server(index, device, microbatch="true") as batched, Server(index, device, microbatch="false") as server,
          httpx.Client(base_url=batched.base, timeout=30, trust_env=False) as http_batched,
          httpx.Client(base_url=server.base, timeout=30, trust_env=False) as http,
          closing(HTTPConnection("127.0.0.1", server.port, timeout=30)) as stdlib):
        calls = {
            "HTTP, batching on": lambda q: post(http_batched, q),
            "HTTP, batching off": lambda q: post(http, q, server_ms),
            "HTTP, stdlib client": lambda q: post_stdlib(stdlib, q),
            "/health": lambda _: http.get("/health"),
            "/health, stdlib": lambda _: get_stdlib(stdlib, "/health"),
            "in-process engine": lambda q: engine.search(q, k),
        }
        times: dict[str, list[float]] = {label: [] for label in calls}
        for call in calls.values():
            for query in queries[:5]:  # warm-up
                call(query)
        server_ms.clear()
        size = max(1, len(queries) // blocks)
        for start in range(0, len(queries), size):
            for label, call in calls.items():
                times[label].extend(timed(call, queries[start : start + size]))
    p50 = {label: statistics.median(values) for label, values in times.items()}
    return {**p50, "server engine (off)": statistics.median(server_ms)}


def batching_ceiling(engine: SearchEngine, k: int, sizes: list[int]) -> dict[int, float]:
    """Queries/s of `engine` in this process at each batch size: what micro-batching can gain on
    this machine before any HTTP cost (and before sharing the cores with the load generator)."""
    queries = QUERIES[:128]
    ceiling = {}
    for size in sizes:
        batches = [queries[i : i + size] for i in range(0, len(queries) - size + 1, size)]
        ceiling[size] = size * 1000 / timed_ms(lambda b: engine.search_batch(b, k), batches + batches)
    return ceiling


def mean_batch(base: str) -> float:
    """Mean requests per forward pass so far, from the server's /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=30, trust_env=False).text
    samples = {sample.name: sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name.startswith("search_batch_size")}
    return samples["search_batch_size_sum"] / max(1.0, samples["search_batch_size_count"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, default=ROOT / "indexes/demo")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30, help="of load per server, over all slices")
    parser.add_argument("--slices", type=int, default=6, help="alternating on/off slices")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=200, help="sequential queries for HTTP vs in-process")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the service's and the engine's")
    args = parser.parse_args()
    if args.slices < 1 or args.clients < 1 or args.seconds <= 0:
        parser.error("--slices and --clients must be at least 1, --seconds above 0")
    if not (args.index / "manifest.json").is_file():
        encoder = BiEncoder(device=args.device)
        print(build_index(BuildOptions(ROOT / "data/demo/corpus.tsv", args.index), encoder).summary())

    results = throughput(args.index, args.device, args.clients, args.seconds, args.slices, args.k)
    rows = {label: result.row() for label, result in results.items()}
    print(f"\n{args.clients} clients x {args.seconds:.0f} s in {args.slices} slices, k={args.k}, "
          f"index {args.index}, device {args.device}")
    print(f"{'':<20}{'requests':>10}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}")
    for label, r in rows.items():
        print(f"{label:<20}{r['requests']:>10}{r['rps']:>10.1f}{r['p50']:>10.1f}{r['p99']:>10.1f}{r['errors']:>8}")
    ratio = rows["micro-batching on"]["rps"] / rows["micro-batching off"]["rps"]
    on, off = results["micro-batching on"].slice_rps, results["micro-batching off"].slice_rps
    pairs = [a / b for a, b in zip(on, off)]
    print(f"throughput on / off = {ratio:.2f}x (slice by slice: {min(pairs):.2f}x to {max(pairs):.2f}x)")
    for label, result in results.items():
        served = max(1, len(result.latencies))
        share = f"load generator {result.client_cpu / result.seconds:.2f} cores ({1000 * result.client_cpu / served:.1f} ms CPU per request)"
        if result.server_cpu is not None:
            share += f", server {result.server_cpu / result.seconds:.2f} cores ({1000 * result.server_cpu / served:.1f} ms)"
        print(f"CPU, {label}: {share}")

    served_batch = results["micro-batching on"].mean_batch
    sizes = sorted({1, max(2, round(served_batch)), 32})
    # opened after the load: it idles meanwhile
    engine = SearchEngine.open(args.index, load=LoadOptions(device=args.device))
    ceiling = batching_ceiling(engine, args.k, sizes)
    print(f"mean batch under load: {served_batch:.1f} requests; in-process ceiling, queries/s by batch size: "
          + ", ".join(f"{size}: {qps:.0f} ({qps / ceiling[1]:.2f}x)" for size, qps in ceiling.items()))

    p50 = http_vs_engine(args.index, args.device, engine, args.rounds, args.k)
    print(f"\none request at a time, p50 ms of {args.rounds} queries:")
    for label, value in p50.items():
        print(f"  {label:<24}{value:>8.2f}")
    engine_ms = p50["in-process engine"]
    print("HTTP / in-process engine = " + ", ".join(
        f"{p50[label] / engine_ms:.2f}x {label.removeprefix('HTTP, ')}" for label in p50 if label.startswith("HTTP")))
    print(f"HTTP batching off / that server's own engine time = {p50['HTTP, batching off'] / p50['server engine (off)']:.2f}x "
          "(the HTTP layer alone, without the engine's own server-versus-loop difference)")


if __name__ == "__main__":
    main()
