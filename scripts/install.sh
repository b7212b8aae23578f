#!/usr/bin/env bash
# Create .venv and install the project with its test tools. torch comes first, pinned to the
# CPU build on this machine's disk; asked for later, pip would fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[dev]"
echo "installed into .venv ($(.venv/bin/python -c 'import torch, faiss; print("torch", torch.__version__, "faiss", faiss.__version__)'))"
