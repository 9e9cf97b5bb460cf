#!/usr/bin/env bash
# Make the base image the Dockerfiles name, `debian:bookworm-slim`, without a registry:
# a minimal Debian bookworm root filesystem made with debootstrap (Debian package) from the
# Debian mirror apt already uses, imported with `docker import`. Users who can pull get the
# official image under the same tag; the Dockerfiles are the same for both.
#
#   ./scripts/base-image.sh            # no-op when the tag exists (cached between runs)
#   ./scripts/base-image.sh --force    # rebuild it
set -euo pipefail
TAG="debian:bookworm-slim"
log() { printf '\033[1m[base-image]\033[0m %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

if [ "${1:-}" != "--force" ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  log "$TAG is present"
  exit 0
fi
if ! command -v debootstrap >/dev/null 2>&1; then
  log "installing debootstrap (Debian package)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
fi
# The mirror apt is configured with (deb.debian.org unless this machine says otherwise).
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
mirror="${mirror:-http://deb.debian.org/debian}"
root=$(mktemp -d /tmp/qm-rootfs.XXXXXX)
trap 'as_root rm -rf "$root"' EXIT
log "debootstrap bookworm (minbase) from $mirror (a few minutes)"
as_root debootstrap --variant=minbase bookworm "$root" "$mirror" >/tmp/qm-debootstrap.log 2>&1 \
  || { tail -20 /tmp/qm-debootstrap.log >&2; exit 1; }
# Slim it like the official image: no apt lists, docs or caches.
as_root rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/locale/*
log "importing it as $TAG"
as_root tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' - "$TAG" >/dev/null
docker image ls "$TAG" >&2
