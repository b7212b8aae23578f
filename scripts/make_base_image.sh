#!/usr/bin/env bash
# A Debian bookworm base image made without a registry: debootstrap from the Debian mirror apt already uses,
# then `docker import`. It holds Python 3.11 with venv, CA certificates and jemalloc, and nothing to compile
# with; docker/Dockerfile.cpu builds on it with --build-arg BASE_IMAGE=dense-search-base:bookworm.
#   sudo scripts/make_base_image.sh [TAG]        (root: debootstrap needs it; TAG default dense-search-base:bookworm)
# A tag that exists already is kept (delete it with `docker rmi TAG` to make it again).
set -euo pipefail

tag=${1:-dense-search-base:bookworm}
mirror=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)}
mirror=${mirror:-http://deb.debian.org/debian}

if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag: there already"
    exit 0
fi
for tool in debootstrap docker; do
    command -v "$tool" >/dev/null || { echo "error: $tool is not installed (apt-get install debootstrap docker.io)" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "error: debootstrap needs root" >&2; exit 2; }

started=$(date +%s)
root=$(mktemp -d /var/tmp/dense-search-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libjemalloc2 \
    bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -n 20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# What a runtime image never reads: package lists, caches, documentation, locales but C.UTF-8.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
       "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
find "$root"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'C.UTF-8' -exec rm -rf {} +
chmod 755 "$root"  # mktemp's 0700 would become the image's /, closed to every user but root
tar -C "$root" --numeric-owner -c . | docker import \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
size=$(docker image inspect "$tag" --format '{{.Size}}')
echo "base image $tag: Debian bookworm from $mirror, $((size / 1000000)) MB, made in $(( $(date +%s) - started )) s"
