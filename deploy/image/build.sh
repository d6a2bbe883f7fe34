#!/bin/bash
# Build the kvshare server image from a Debian base made here: no pulled base image.
#
#   deploy/image/build.sh            # prints the reference, localhost/kvshare:VERSION, last
#   KVSHARE_IMAGE_REBUILD=1 deploy/image/build.sh   # rebuild even if an image of the
#                                                    # same inputs is there
#   KVSHARE_IMAGE_KEEP=1 deploy/image/build.sh      # keep the work directory (debugging)
#
# Needs root (mmdebstrap's root mode, chroot), podman, mmdebstrap, and the network to a
# Debian mirror (KVSHARE_DEBIAN_MIRROR) and to the Python package index pip is set up
# for. Three steps:
#   1. the server's locked dependencies (constraints.txt; kvshare[cluster]: the Redis
#      Cluster tier's client, no torch) as manylinux wheels for CPython 3.11.2 (bookworm's: markers on the full version), installed
#      into a directory by pip on this host (no pip in the image);
#   2. a builder root file system by mmdebstrap (Debian bookworm with its security and
#      point-release updates; python3 and python3-venv): the venv at /opt/kvshare, the
#      packages from step 1 copied into it, every module compiled (the image's root file
#      system is read-only);
#   3. the final root file system (assemble.py): only the files of the Debian packages
#      python3.11 needs at run time (dependency closure, no shell, no package manager,
#      no compiler), the venv, the user kvshare (10001:10001), the directories the
#      server writes, a placeholder config, and an SBOM (CycloneDX JSON) of every Debian
#      and Python package in the image; imported with podman, OCI labels set.
# An image whose `dev.kvshare.inputs` label equals the hash of this build's inputs (the
# product packages' sources, pyproject.toml, constraints.txt, deploy/image/) is reused.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
mirror="${KVSHARE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
security="${KVSHARE_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}"
suite=bookworm

log() { printf 'build.sh: %s\n' "$*" >&2; }
fail() { printf 'build.sh: error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "run as root (mmdebstrap's root mode and chroot need it)"
for tool in podman mmdebstrap chroot; do
    command -v "$tool" >/dev/null || fail "$tool is missing: apt-get install podman mmdebstrap"
done

version="$("$python" "$here/assemble.py" version "$repo")"
inputs="$("$python" "$here/assemble.py" inputs "$repo")"
ref="localhost/kvshare:$version"

# Podman on this kind of host: runc (crun refuses hybrid cgroups) and ulimits within the
# hard limit; a CONTAINERS_CONF given by the caller wins.
if [ -z "${CONTAINERS_CONF:-}" ]; then
    export CONTAINERS_CONF="${TMPDIR:-/tmp}/kvshare-containers.conf"
    "$python" "$here/assemble.py" containers-conf > "$CONTAINERS_CONF"
fi

if [ "${KVSHARE_IMAGE_REBUILD:-0}" != 1 ] && podman image exists "$ref"; then
    have="$(podman image inspect --format '{{ index .Labels "dev.kvshare.inputs" }}' "$ref")"
    if [ "$have" = "$inputs" ]; then
        log "$ref is built from these inputs already (dev.kvshare.inputs $inputs): reused"
        echo "$ref"
        exit 0
    fi
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/kvshare-image.XXXXXX")"
cleanup() {
    # mmdebstrap unmounted the builder's /proc, /sys and /dev; nothing is mounted here.
    if [ "${KVSHARE_IMAGE_KEEP:-0}" = 1 ]; then log "kept $work"; else rm -rf --one-file-system "$work"; fi
}
trap cleanup EXIT
started=$SECONDS

log "1/3 the server's locked dependencies (pip, constraints.txt)"
"$python" -m pip wheel --quiet --no-deps --no-build-isolation -w "$work/dist" "$repo" >&2
wheel="$(ls "$work"/dist/kvshare-*.whl)"
"$python" -m pip install --quiet --no-compile --no-warn-script-location \
    --target "$work/site" --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --implementation cp --python-version 3.11.2 --abi cp311 \
    -c "$repo/constraints.txt" "kvshare[cluster] @ file://$wheel" "async-timeout>=4.0.3,<6" >&2
# async-timeout: pip evaluates markers against the interpreter running it, not
# --python-version, and redis needs it below Python 3.11.3 (bookworm's is 3.11.2).
rm -rf "$work/site/bin"  # console scripts with this host's interpreter: made in step 3

log "2/3 the builder root file system (mmdebstrap $suite)"
mmdebstrap --mode=root --variant=essential --quiet \
    --include=python3,python3-venv,libstdc++6,ca-certificates \
    --customize-hook='chroot "$1" python3 -m venv --without-pip /opt/kvshare' \
    "$suite" "$work/builder" \
    "deb $mirror $suite main" "deb $mirror $suite-updates main" \
    "deb $security $suite-security main" >&2
site="$work/builder/opt/kvshare/lib/python3.11/site-packages"
cp -a "$work/site/." "$site/"
chroot "$work/builder" /usr/bin/python3 -m compileall -q -j 0 /opt/kvshare/lib >&2

log "3/3 the final root file system, SBOM, import"
"$python" "$here/assemble.py" rootfs "$repo" "$work/builder" "$work/rootfs" >&2
revision="$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)"
previous="$(podman image inspect --format '{{ .Id }}' "$ref" 2>/dev/null || true)"
created="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
tar -C "$work/rootfs" --numeric-owner -cf - . | podman import --quiet \
    --change 'USER 10001:10001' \
    --change 'WORKDIR /var/lib/kvshare' \
    --change 'ENV PATH=/opt/kvshare/bin:/usr/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PYTHONDONTWRITEBYTECODE=1' \
    --change 'ENV PYTHONUNBUFFERED=1' \
    --change 'EXPOSE 50051/tcp' --change 'EXPOSE 50052/tcp' --change 'EXPOSE 9464/tcp' \
    --change 'VOLUME ["/var/lib/kvshare"]' \
    --change 'STOPSIGNAL SIGTERM' \
    --change 'CMD ["kvshare", "serve", "--config", "/etc/kvshare/kvshare.toml"]' \
    --change "LABEL org.opencontainers.image.title=kvshare" \
    --change "LABEL org.opencontainers.image.description=\"kvshare server: a multi-tenant, secure prefix-KV-cache block store\"" \
    --change "LABEL org.opencontainers.image.version=$version" \
    --change "LABEL org.opencontainers.image.revision=$revision" \
    --change "LABEL org.opencontainers.image.created=$created" \
    --change "LABEL org.opencontainers.image.licenses=Apache-2.0" \
    --change "LABEL org.opencontainers.image.base.name=debian:$suite-mmdebstrap" \
    --change "LABEL dev.kvshare.sbom=/usr/share/kvshare/sbom.cdx.json" \
    --change "LABEL dev.kvshare.inputs=$inputs" \
    - "$ref" >&2
# The image this one replaces under the same reference, unless a container still uses it.
if [ -n "$previous" ] && [ "$previous" != "$(podman image inspect --format '{{ .Id }}' "$ref")" ]; then
    podman rmi "$previous" >/dev/null 2>&1 || true
fi
size="$(podman image inspect --format '{{ .Size }}' "$ref")"
log "built $ref in $((SECONDS - started)) s: $((size / 1024 / 1024)) MiB"
echo "$ref"
