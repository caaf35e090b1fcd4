#!/usr/bin/env bash
# Starts a Docker daemon when none answers (CI machines, containers without systemd): overlay2
# where the kernel allows it, else vfs (slower, works everywhere). Its log: $DOCKERD_LOG.
set -euo pipefail
log="${DOCKERD_LOG:-/tmp/dockerd.log}"
docker info >/dev/null 2>&1 && exit 0
command -v dockerd >/dev/null || { echo "start_dockerd.sh: dockerd not found (apt-get install -y docker.io)" >&2; exit 1; }
for driver in overlay2 vfs; do
    echo "starting dockerd (storage driver $driver), log in $log" >&2
    nohup dockerd --storage-driver "$driver" >>"$log" 2>&1 &
    pid=$!
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && exit 0
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
done
echo "start_dockerd.sh: dockerd did not start with overlay2 or vfs (see $log)" >&2
exit 1
