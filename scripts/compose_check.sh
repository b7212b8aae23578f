#!/usr/bin/env bash
# The deployment, run end to end on this machine with Docker Compose (v2 or docker-compose 1.29), on the
# host's network (docker-compose.host.yml), from images built here: each step printed with its seconds; the
# first that fails ends the run, non-zero, naming it. It starts dockerd where none runs and it may (root),
# makes the base image (scripts/make_base_image.sh) and the wheelhouse (scripts/wheelhouse.sh) where missing,
# builds the CPU and Prometheus images, and removes only what it started: its compose project
# (dense-search-check: containers and volumes) and the dockerd it started. The images stay, for the next run.
#   sudo scripts/compose_check.sh
# Ports 8000, 8001, 8100 and 9090 must be free.
set -uo pipefail
cd "$(dirname "$0")/.."

export COMPOSE_PROJECT_NAME=dense-search-check
export INDEXES_VOLUME=dense-search-check_indexes MODELS_VOLUME=dense-search-check_models
export METRICS_VOLUME=dense-search-check_metrics
export BASE_IMAGE=${BASE_IMAGE:-dense-search-base:bookworm} WHEELS=${WHEELS:-wheelhouse}
export PROMETHEUS_BASE_IMAGE=${PROMETHEUS_BASE_IMAGE:-$BASE_IMAGE}
export SEARCH_IMAGE=${SEARCH_IMAGE:-dense-search:cpu} PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-dense-search-prometheus}
# The writer compacts a few seconds after a write, so the replicas follow its new generation within the run.
export SEARCH_COMPACT_AGE_S=${SEARCH_COMPACT_AGE_S:-5} SEARCH_WATCH_INTERVAL_S=${SEARCH_WATCH_INTERVAL_S:-1}
compose_files=(-f docker-compose.yml -f docker-compose.host.yml)
if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi
scratch=$(mktemp -d)
started_dockerd=""

compose() { "${compose[@]}" "${compose_files[@]}" --profile replicas --profile writer "$@"; }

cleanup() {
    compose down -v --remove-orphans >/dev/null 2>&1
    rm -rf "$scratch"
    if [ -n "$started_dockerd" ]; then kill "$started_dockerd" 2>/dev/null; wait "$started_dockerd" 2>/dev/null; fi
}
trap cleanup EXIT

step_started=0 step_name="" run_started=$(date +%s.%N)
step() { step_name=$1; step_started=$(date +%s.%N); }
since() { awk -v start="$1" -v now="$(date +%s.%N)" 'BEGIN { printf "%.1f", now - start }'; }  # seconds since $1
done_step() { printf '%-58s %7s s%s\n' "$step_name" "$(since "$step_started")" "${1:+  ($1)}"; }
fail() {
    echo "FAILED: $step_name: $*" >&2
    compose ps >&2 2>/dev/null
    exit 1
}

# wait_for SECONDS COMMAND...: until COMMAND succeeds, at most SECONDS.
wait_for() {
    local deadline=$(( $(date +%s) + $1 )); shift
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$deadline" ] || return 1
        sleep 1
    done
}
health() { docker inspect --format '{{.State.Health.Status}}' "$(compose ps -q "$1")" 2>/dev/null; }
healthy() { [ "$(health "$1")" = healthy ]; }
search() {  # search PORT QUERY: the ids of its top 5, one a line
    curl -sf "localhost:$1/search" -H 'content-type: application/json' -d "{\"query\": \"$2\", \"k\": 5}" \
        | python3 -c 'import json, sys; print("\n".join(hit["id"] for hit in json.load(sys.stdin)["results"]))'
}
answers() {  # answers PORT QUERY ID: ID is among the query's top 5
    local ids
    ids=$(search "$1" "$2") && grep -qx "$3" <<<"$ids"
}
generation_moved() {  # generation_moved PORT GENERATION: the instance serves another generation now
    [ "$(generation "$1")" != "$2" ]
}
generation() {
    curl -sf "localhost:$1/ready" | python3 -c 'import json, sys; print(json.load(sys.stdin)["index"]["generation"])'
}

step "docker engine"
if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null && [ "$(id -u)" = 0 ] || fail "no Docker engine runs and none can be started here"
    dockerd --storage-driver vfs --bridge none --iptables=false --ip-masq=false >"$scratch/dockerd.log" 2>&1 &
    started_dockerd=$!
    wait_for 60 docker info || fail "dockerd did not start: $(tail -n 3 "$scratch/dockerd.log")"
fi
done_step "$(docker version --format 'engine {{.Server.Version}}'), ${compose[*]} $("${compose[@]}" version --short 2>/dev/null)"

step "base image ($BASE_IMAGE)"
if [[ $BASE_IMAGE == dense-search-base:* ]]; then
    scripts/make_base_image.sh "$BASE_IMAGE" >"$scratch/base.log" 2>&1 || fail "$(tail -n 5 "$scratch/base.log")"
fi
docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || fail "no image $BASE_IMAGE"
done_step "$(tail -n 1 "$scratch/base.log" 2>/dev/null)"

if [ "$WHEELS" = wheelhouse ]; then
    step "wheelhouse (docker/wheelhouse)"
    if ! ls docker/wheelhouse/torch-*+cpu-*.whl >/dev/null 2>&1; then  # none, or the GPU image's CUDA build
        scripts/wheelhouse.sh cpu >"$scratch/wheels.log" 2>&1 || fail "$(tail -n 5 "$scratch/wheels.log")"
    fi
    done_step "$(ls docker/wheelhouse/*.whl | wc -l) wheels"
fi

step "image $SEARCH_IMAGE (docker/Dockerfile.cpu)"
DOCKER_BUILDKIT=0 docker build --network host -q -f docker/Dockerfile.cpu -t "$SEARCH_IMAGE" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg WHEELS="$WHEELS" . >"$scratch/build.log" 2>&1 \
    || fail "$(tail -n 20 "$scratch/build.log")"
size=$(docker image inspect "$SEARCH_IMAGE" --format '{{.Size}}')
done_step "$((size / 1000000)) MB"

step "image $PROMETHEUS_IMAGE (docker/prometheus)"
DOCKER_BUILDKIT=0 docker build --network host -q -t "$PROMETHEUS_IMAGE" --build-arg BASE_IMAGE="$PROMETHEUS_BASE_IMAGE" \
    docker/prometheus >"$scratch/build-prometheus.log" 2>&1 || fail "$(tail -n 20 "$scratch/build-prometheus.log")"
done_step "$(( $(docker image inspect "$PROMETHEUS_IMAGE" --format '{{.Size}}') / 1000000 )) MB"

step "the image runs as a non-root user, with no compiler and no pip"
who=$(docker run --rm --network host "$SEARCH_IMAGE" sh -c 'id -u; command -v gcc cc pip pip3 || true') \
    || fail "the image does not run"
[ "$(echo "$who" | head -n 1)" != 0 ] || fail "it runs as root"
[ "$(echo "$who" | wc -l)" = 1 ] || fail "it holds $(echo "$who" | tail -n +2 | tr '\n' ' ')"
done_step "uid $(echo "$who" | head -n 1)"

step "up: index-builder builds the demo index, search healthy"
compose down -v --remove-orphans >/dev/null 2>&1
compose up -d --no-build search >"$scratch/up.log" 2>&1 || fail "$(tail -n 20 "$scratch/up.log")"
builder=$(compose ps -q index-builder)
[ "$(docker inspect --format '{{.State.ExitCode}}' "$builder")" = 0 ] || fail "index-builder: $(docker logs --tail 5 "$builder" 2>&1)"
wait_for 300 healthy search || fail "search is $(health search): $(compose logs --tail 10 search)"
done_step "$(docker logs "$builder" 2>/dev/null | grep -m 1 '^built ' | cut -c1-90)"

step "first answer: /search and /search/batch"
ids=$(search 8000 "join two paths") || fail "/search did not answer"
[ "$(echo "$ids" | wc -l)" = 5 ] || fail "/search answered $(echo "$ids" | wc -l) hits, not 5"
batch=$(curl -sf localhost:8000/search/batch -H 'content-type: application/json' \
    -d '{"queries": ["join two paths", "read a file"], "k": 3}') || fail "/search/batch did not answer"
echo "$batch" | python3 -c 'import json, sys; r = json.load(sys.stdin)["results"]; assert len(r) == 2 and all(len(x["results"]) == 3 for x in r)' \
    || fail "/search/batch answered $batch"
done_step "top hit $(echo "$ids" | head -n 1)"

step "the index volume is read-only to a replica"
denied=$(compose exec -T search sh -c 'touch /indexes/main/x 2>&1; touch /indexes/x 2>&1' || true)
[ "$(echo "$denied" | grep -c 'Read-only file system')" = 2 ] || fail "a replica could write: $denied"
done_step

step "writer up, a write acknowledged"
compose up -d --no-build writer >"$scratch/up.log" 2>&1 || fail "$(tail -n 20 "$scratch/up.log")"
wait_for 300 healthy writer || fail "writer is $(health writer): $(compose logs --tail 10 writer)"
before=$(generation 8100)
written=$(curl -sf localhost:8100/passages -H 'content-type: application/json' \
    -d '{"passages": [{"id": "check-1", "text": "zebra crossings of the Okavango delta in the dry season"}]}') \
    || fail "POST /passages was not answered"
grep -q '"upserted":1' <<<"$written" || fail "POST /passages answered $written"
done_step "$written"

step "the write survives docker kill -s KILL and a restart"
docker kill -s KILL "$(compose ps -q writer)" >/dev/null || fail "kill failed"
killed=$(date +%s.%N)
compose start writer >/dev/null 2>&1 || fail "the writer did not start again"
wait_for 300 curl -sf localhost:8100/ready || fail "the writer did not get ready again: $(compose logs --tail 10 writer)"
restarted=$(since "$killed")
answers 8100 "zebra crossings Okavango" check-1 || fail "the acknowledged write is gone"
stored=$(curl -sf localhost:8100/passages/check-1) && grep -q Okavango <<<"$stored" || fail "GET /passages/check-1 does not hold it"
done_step "ready again $restarted s after the kill"

step "replicas follow the writer's compaction"
compose up -d --no-build search-2 >"$scratch/up.log" 2>&1 || fail "$(tail -n 20 "$scratch/up.log")"
wait_for 300 healthy search-2 || fail "search-2 is $(health search-2)"
wait_for 120 generation_moved 8100 "$before" || fail "the writer did not compact within 120 s"
published=$(date +%s.%N)
for port in 8000 8001; do
    wait_for 120 answers "$port" "zebra crossings Okavango" check-1 \
        || fail "the replica on $port did not follow the writer's generation"
done
done_step "both replicas answer it $(since "$published") s after the compaction"

step "monitoring: Prometheus scrapes every instance"
compose up -d --no-build prometheus >"$scratch/up.log" 2>&1 || fail "$(tail -n 20 "$scratch/up.log")"
targets() {
    curl -sf localhost:9090/api/v1/targets | python3 -c '
import json, sys
active = json.load(sys.stdin)["data"]["activeTargets"]
print(" ".join("%s=%s" % (t["labels"]["instance"], t["health"]) for t in active))
sys.exit(not active or any(t["health"] != "up" for t in active))'
}
wait_for 90 targets || fail "targets: $(targets)"
wait_for 60 sh -c 'curl -sf "localhost:9090/api/v1/query?query=search_ready" | grep -q "\"1\""' \
    || fail "no search_ready series in Prometheus"
rules=$(curl -sf localhost:9090/api/v1/rules | python3 -c 'import json, sys; print(sum(len(g["rules"]) for g in json.load(sys.stdin)["data"]["groups"]))')
done_step "$(targets), $rules alert rules loaded"

step "the writer stopped, index_builder update run in a container"
compose stop writer >/dev/null 2>&1 || fail "the writer did not stop"
before=$(generation 8001)
printf 'check-2\tquokkas of Rottnest island sleep through the afternoon heat\n' >"$scratch/more.tsv"
chmod 755 "$scratch"; chmod 644 "$scratch/more.tsv"
compose run --rm --no-deps -v "$scratch/more.tsv:/updates/more.tsv:ro" index-builder \
    python -m index_builder update --index /indexes/main --add /updates/more.tsv --device cpu >"$scratch/update.log" 2>&1 \
    || fail "$(tail -n 10 "$scratch/update.log")"
updated=$(date +%s.%N)
wait_for 120 answers 8001 "quokkas Rottnest island" check-2 || fail "search-2 did not follow the new generation"
followed=$(since "$updated")
[ "$(generation 8001)" != "$before" ] || fail "search-2 still serves generation $before"
done_step "search-2 answers from it $followed s after update exited"

step "docker compose stop drains within the grace period"
compose stop -t 30 search >/dev/null 2>&1 || fail "stop failed"
logs=$(compose logs search 2>&1)
grep -q "drained: " <<<"$logs" || fail "no drain line in the logs"
[ "$(docker inspect --format '{{.State.ExitCode}}' "$(compose ps -q search)")" = 0 ] \
    || fail "search exited $(docker inspect --format '{{.State.ExitCode}}' "$(compose ps -q search)")"
done_step "$(echo "$logs" | grep "drained: " | tail -n 1 | sed 's/.*service.http.app: //')"

echo "compose check: every step passed in $(since "$run_started") s"
