#!/usr/bin/env bash
# The wheels an image needs, fetched on this host with its own pip settings (its index, certificates and
# find-links) into docker/wheelhouse, for `docker build --build-arg WHEELS=wheelhouse`, which reads nothing
# else: the air-gapped pattern (docs/deployment.md).
#   scripts/wheelhouse.sh [cpu|gpu]      (default cpu: CPU torch; gpu: PyPI's CUDA torch and the gpu extra)
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-cpu}
python=${PYTHON:-python3}
case "$kind" in
    cpu) extras="tracing"; torch="torch==2.13.0" ;;
    # ===: exactly 2.13.0, PyPI's CUDA build; == would also take a local 2.13.0+cpu wheel (find-links), and prefer it
    gpu) extras="gpu,tracing"; torch="torch===2.13.0" ;;
    *) echo "error: cpu or gpu, not $kind" >&2; exit 2 ;;
esac
started=$(date +%s)
rm -f docker/wheelhouse/*.whl  # one kind at a time: the other's torch would satisfy torch==2.13.0 as well
# The build backend too: the image builds the project's own wheel with nothing but these.
"$python" -m pip wheel --quiet --wheel-dir docker/wheelhouse "setuptools>=68" wheel "$torch" ".[$extras]"
rm -rf docker/wheelhouse/dense_search-*.whl build  # the image builds the project from the sources it copies
echo "wheelhouse: $(ls docker/wheelhouse/*.whl | wc -l) wheels, $(du -sm docker/wheelhouse | cut -f1) MB in docker/wheelhouse ($kind), $(( $(date +%s) - started )) s"
