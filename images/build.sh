#!/usr/bin/env bash
# Builds the images on a machine that reaches Debian's archive and PyPI but no image registry
# (CI, these development machines): from the local Debian base (images/build_base.sh, built when
# absent) with host networking, and torch's CPU wheel from pip's find-links directory when that
# holds it (torch's CPU index may be unreachable). Elsewhere, `docker build` as the Dockerfiles'
# headers say does the same from public images.
#
#   images/build.sh operator engine-cpu [engine-gpu]
#
# TAG (default dev) tags kvfleet/<image>:TAG; BASE_IMAGE overrides the base; TORCH_WHEEL_PORT
# (default 47381) is the loopback port of the CPU wheel's index; the build time and
# size of each image are printed. The images an earlier build left untagged (the one a tag pointed
# to before, a multi-stage build's first stage) are removed afterwards: a machine that builds on
# every commit otherwise fills its disk, 1.7 GB a build.
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${TAG:-dev}"
base="${BASE_IMAGE:-kvfleet-base:bookworm}"
torch="$(grep -m1 '^torch==' images/torch.txt)"
[ $# -gt 0 ] || { echo "usage: images/build.sh operator|engine-cpu|engine-gpu ..." >&2; exit 2; }
started="$(date -u +%Y-%m-%dT%H:%M:%S.%NZ)"

if [ -z "${BASE_IMAGE:-}" ] && ! docker image inspect "$base" >/dev/null 2>&1; then
    images/build_base.sh "$base"
fi

# torch's CPU wheel served as a one-package index on the loopback, which the build (host
# network) reaches: the wheel of pip's find-links directory for this torch version. Sets
# cpu_index (torch's public CPU index when there is no such wheel).
serve_cpu_wheel() {
    local links wheel port
    cpu_index="https://download.pytorch.org/whl/cpu"
    links="$(python3 -m pip config get global.find-links 2>/dev/null || echo "${PIP_FIND_LINKS:-}")"
    [ -n "$links" ] || return 0
    # shellcheck disable=SC2086 # pip's setting is a whitespace-separated list
    wheel="$(find $links -maxdepth 1 -name "${torch/==/-}+cpu-*.whl" 2>/dev/null | head -n1)"
    [ -n "$wheel" ] || return 0
    dir="$(mktemp -d)"
    mkdir "$dir/torch"
    ln -s "$wheel" "$dir/torch/"
    # One port from build to build where it is free: the index's URL is a build argument, and a
    # new value misses the layer cache of every RUN after it (all of the image's layers).
    # SO_REUSEADDR, as the server sets it: the last build's connections may hold the port in
    # TIME_WAIT for a minute.
    port="$(python3 -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])' "${TORCH_WHEEL_PORT:-47381}")"
    python3 -m http.server --bind 127.0.0.1 --directory "$dir" "$port" >/dev/null 2>&1 &
    server=$!
    trap 'kill "$server"; rm -rf "$dir"' EXIT
    cpu_index="http://127.0.0.1:$port/"
    echo "torch's CPU wheel served at $cpu_index"
    sleep 1
}

build() {
    local name="$1" start
    shift
    start="$(date +%s)"
    docker build --network host --build-arg "BASE_IMAGE=$base" -t "kvfleet/$name:$tag" "$@" .
    echo "kvfleet/$name:$tag built in $(($(date +%s) - start)) s," \
        "$(docker image inspect -f '{{.Size}}' "kvfleet/$name:$tag" | awk '{printf "%.0f MB", $1/1e6}')"
}

for image in "$@"; do
    case "$image" in
        operator) build operator -f images/operator.Dockerfile ;;
        engine-cpu)
            serve_cpu_wheel
            build engine-cpu -f images/engine.Dockerfile --target cpu \
                --build-arg "TORCH_INDEX_URL=$cpu_index"
            ;;
        engine-gpu)
            build engine-gpu -f images/engine.Dockerfile --target gpu
            ;;
        *) echo "images/build.sh: unknown image $image (operator, engine-cpu, engine-gpu)" >&2; exit 2 ;;
    esac
done

# Only untagged images from before this build: its own first stages are the next build's cache.
docker image prune -f --filter label=org.opencontainers.image.vendor=kvfleet \
    --filter "until=$started" | tail -n1
