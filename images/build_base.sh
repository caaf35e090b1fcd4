#!/usr/bin/env bash
# Builds the local stand-in for the images' public base (python:3.11-slim-bookworm) from Debian's
# own packages, for machines that reach Debian's archive and PyPI but no image registry:
# Debian bookworm (Python 3.11, as the public base) with python3-venv and this machine's CA
# bundle, so that pip inside `docker build --network host` trusts what this machine trusts.
#
#   images/build_base.sh [TAG]        (default kvfleet-base:bookworm; mmdebstrap as root: sudo
#                                      when not root)
set -euo pipefail
tag="${1:-kvfleet-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
bundle="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
for tool in mmdebstrap docker; do
    command -v "$tool" >/dev/null || { echo "build_base.sh: $tool not found (apt-get install -y mmdebstrap docker.io)" >&2; exit 1; }
done
[ -r "$bundle" ] || { echo "build_base.sh: no CA bundle at $bundle (set CA_BUNDLE)" >&2; exit 1; }
# mmdebstrap's root mode: its unshare mode needs unprivileged user namespaces, which hosts
# (Ubuntu 24.04 runners among them) often restrict.
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# minbase: dpkg, apt and essentials only; the merged-usr hook rather than the usrmerge package
# (which pulls in perl: 46 MB). The bundle replaces Debian's after ca-certificates is set up (a
# later update-ca-certificates in the image would regenerate Debian's alone). `python`: what the
# public base offers besides python3. Documentation and translations are left out, as in
# Debian's own slim images.
# shellcheck disable=SC2016 # the hooks' $1 (the root) is expanded by mmdebstrap's shell
"${as_root[@]}" mmdebstrap --quiet --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --include=python3,python3-venv,ca-certificates \
    --customize-hook="cp '$bundle' \"\$1/etc/ssl/certs/ca-certificates.crt\"" \
    --customize-hook='ln -sf python3 "$1/usr/bin/python"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    bookworm "$work/base.tar" "$mirror"
docker import --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' "$work/base.tar" "$tag" >/dev/null
echo "built $tag ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
