"""`/v1/embeddings` against Infinity (infinity-emb) serving the same MiniLM folder, on loopback.

    python bench/peers.py [--index indexes/demo] [--clients 16] [--seconds 30] [--slices 6]
                          [--venv runs/peers/infinity-venv] [--backend torch]

Infinity is installed by this script, where missing, into its own virtual environment (`--venv`:
torch==2.13.0 first, a CPU build, then `infinity-emb[server,torch]`), and started with its torch
engine on the CPU over the model folder the index's encoder was loaded from (the packaged
all-MiniLM-L6-v2 for the demo index). Ours is `python -m service` on the same index
(`SEARCH_BACKEND=--backend`). Both are up at once and loaded in turn, in `--slices` alternating
slices (ours, theirs, theirs, ours, ...), by the same `--clients` concurrent httpx clients of
this process, with the same requests: one demo query per request, then batches of 32.
Printed: requests/s and p50 per server and shape, and ours as a ratio to Infinity's (goal,
issue 16: at least as fast on both), with the largest difference between the two servers'
embeddings of the same texts (they must be the same model).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import QUERIES, Process, Request, Server, alternate  # noqa: E402
from bench.ports import unclaimed_ports  # noqa: E402
from index_builder.build import BuildOptions, build_index  # noqa: E402
from models.encoder import BiEncoder, default_model_path  # noqa: E402
from retrieval.index_format import read_manifest  # noqa: E402

INFINITY = "infinity-emb[server,torch]==0.0.78"
SHAPES = {"single input": 1, "batches of 32": 32}


def install_infinity(venv: Path) -> Path:
    """The infinity_emb executable in `venv`, installing it there first where it is missing."""
    executable = venv / "bin" / "infinity_emb"
    if executable.exists():
        return executable
    print(f"installing {INFINITY} into {venv} (a few minutes, once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # first, so pip never pulls a CUDA build
    subprocess.run([*pip, INFINITY], check=True)
    return executable


class Infinity(Process):
    """`infinity_emb v2` on a loopback port over `model`, stopped on exit."""

    ready_path = "/health"
    startup_s = 300

    def __init__(self, executable: Path, model: Path, batch_size: int) -> None:
        [port] = unclaimed_ports(1)
        environment = {**os.environ, "INFINITY_ANONYMOUS_USAGE_STATS": "0", "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}
        super().__init__([str(executable), "v2", "--model-id", str(model), "--served-model-name", "minilm",
                          "--engine", "torch", "--device", "cpu", "--batch-size", str(batch_size),
                          "--host", "127.0.0.1", "--port", str(port)], environment, port)


def embeddings(base: str, path: str, texts: list[str]) -> np.ndarray:
    answer = httpx.post(f"{base}{path}", json={"input": texts, "model": "minilm", "encoding_format": "float"},
                        timeout=120, trust_env=False)
    answer.raise_for_status()
    return np.array([item["embedding"] for item in sorted(answer.json()["data"], key=lambda item: item["index"])])


def embed_request(path: str, size: int) -> Request:
    """The pool's i-th request: `size` demo queries, each client's own."""
    return lambda i: (path, {"input": [QUERIES[(i * size + j) % len(QUERIES)] for j in range(size)],
                             "model": "minilm", "encoding_format": "float"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--index", type=Path, default=ROOT / "indexes/demo")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0, help="of load per server and shape, over all slices")
    parser.add_argument("--slices", type=int, default=6)
    parser.add_argument("--venv", type=Path, default=ROOT / "runs/peers/infinity-venv")
    parser.add_argument("--backend", default="torch", choices=["torch", "onnx", "onnx-int8"], help="ours")
    args = parser.parse_args(argv)

    if not (args.index / "manifest.json").exists():
        print(f"building {args.index} from the demo corpus first", flush=True)
        build_index(BuildOptions(ROOT / "data/demo/corpus.tsv", args.index), BiEncoder(device="cpu"))
    recorded = read_manifest(args.index).encoder.path
    model = Path(recorded) if recorded else default_model_path()
    executable = install_infinity(args.venv)

    ours_label, theirs_label = f"dense-search ({args.backend})", "infinity (torch)"
    with Server(args.index, "cpu", backend=args.backend) as ours, Infinity(executable, model, 32) as theirs:
        # Infinity 0.0.78 serves OpenAI's shape at /embeddings; ours at /v1/embeddings.
        routes = {ours_label: (ours.base, "/v1/embeddings"), theirs_label: (theirs.base, "/embeddings")}
        texts = QUERIES[:32]
        difference = np.abs(embeddings(ours.base, "/v1/embeddings", texts) - embeddings(theirs.base, "/embeddings", texts))
        print(f"same texts, both servers: largest embedding difference {difference.max():.2e}")
        rows = {}
        for shape, size in SHAPES.items():
            targets = {label: (base, embed_request(path, size)) for label, (base, path) in routes.items()}
            rows[shape] = asyncio.run(alternate(targets, args.clients, args.seconds, args.slices))

    print(f"\n/v1/embeddings, {args.clients} clients, {args.seconds:g} s per server and shape in {args.slices} "
          f"alternating slices, model {read_manifest(args.index).encoder.name} ({model})")
    for shape, results in rows.items():
        mine, peer = results[ours_label].row(), results[theirs_label].row()
        for label, row in ((ours_label, mine), (theirs_label, peer)):
            print(f"{shape:14s} {label:24s}: {row['rps']:7.1f} req/s ({row['rps'] * SHAPES[shape]:7.1f} texts/s), "
                  f"p50 {row['p50']:7.1f} ms, p99 {row['p99']:7.1f} ms, {row['errors']} errors")
        print(f"{shape:14s} ours / infinity: {mine['rps'] / peer['rps']:.2f}x req/s, "
              f"p50 {peer['p50'] / mine['p50']:.2f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
