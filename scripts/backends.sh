#!/usr/bin/env bash
# Quality of each encoder backend (torch, onnx, onnx-int8) on Cranfield and on the SciFact dev
# split (the recipe's seeded 20%): one index per collection and backend, passages and queries
# encoded by that backend, nDCG@10 of dense retrieval; then int8 queries over the torch index
# (SEARCH_BACKEND=onnx-int8 over an fp32 index: the service's fast query path, passages exact).
#
#   bash scripts/backends.sh            -> $WORK/{cranfield,scifact}-BACKEND/ and $WORK/table.txt
#
# Environment: WORK (default runs/backends), CRANFIELD (../shared/data/cranfield), SCIFACT
# (../shared/data/scifact-train), PYTHON (.venv/bin/python). A missing collection is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-runs/backends}
PY=${PYTHON:-.venv/bin/python}
CRANFIELD=${CRANFIELD:-../shared/data/cranfield}
SCIFACT=${SCIFACT:-../shared/data/scifact-train}
mkdir -p "$WORK"
: > "$WORK/table.txt"

collections=()
if [ -f "$CRANFIELD/cran.all.1400" ]; then
    [ -f "$WORK/cranfield-data/qrels.txt" ] || $PY -m index_builder convert-cranfield --data "$CRANFIELD" --out "$WORK/cranfield-data"
    collections+=("cranfield $WORK/cranfield-data/corpus.tsv $WORK/cranfield-data/queries.tsv $WORK/cranfield-data/qrels.txt")
else
    echo "skipped Cranfield: no $CRANFIELD" >&2
fi
if [ -f "$SCIFACT/corpus.jsonl" ]; then
    $PY -m training.split --queries "$SCIFACT/queries-train.jsonl" \
        --qrels "$SCIFACT/qrels-train.tsv" --out "$WORK/scifact-split" --dev-share 0.2 --seed 13
    collections+=("scifact $SCIFACT/corpus.jsonl $WORK/scifact-split/queries-dev.tsv $WORK/scifact-split/qrels-dev.txt")
else
    echo "skipped SciFact: no $SCIFACT" >&2
fi

for entry in "${collections[@]}"; do
    read -r name corpus queries qrels <<< "$entry"
    for backend in torch onnx onnx-int8; do
        index=$WORK/$name-$backend
        started=$SECONDS
        $PY -m index_builder build --corpus "$corpus" --out "$index" --backend "$backend" --device cpu --if-missing
        echo "$name $backend build: $((SECONDS - started)) s" | tee -a "$WORK/table.txt"
        $PY -m index_builder eval --index "$index" --queries "$queries" --qrels "$qrels" --modes dense --k 100 \
            --device cpu | sed "s/^/$name $backend  /" | tee -a "$WORK/table.txt"
    done
    $PY -m index_builder eval --index "$WORK/$name-torch" --queries "$queries" --qrels "$qrels" --modes dense --k 100 \
        --device cpu --backend onnx-int8 | sed "s/^/$name torch-index int8-queries  /" | tee -a "$WORK/table.txt"
done
