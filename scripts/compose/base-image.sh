#!/usr/bin/env bash
# The base image of every image the harness builds: Debian $DEBIAN_RELEASE minbase with
# python3 and python3-venv from Debian, made with debootstrap (no registry is reached: only
# the Debian mirror, as apt does). The rootfs tarball is cached under $PDPROC_COMPOSE_CACHE,
# keyed on the release, and imported into the running engine as $BASE_IMAGE.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

PACKAGES=python3,python3-venv
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TARBALL=$PDPROC_COMPOSE_CACHE/debian-$DEBIAN_RELEASE-minbase-python3.tar

if [ ! -s "$TARBALL" ]; then
  command -v debootstrap >/dev/null || die "debootstrap missing: scripts/compose/engine.sh install"
  rootfs=$(mktemp -d "${TMPDIR:-/var/tmp}/pdproc-rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' EXIT
  log "debootstrap $DEBIAN_RELEASE (minbase + $PACKAGES) from $MIRROR"
  debootstrap --variant=minbase --include="$PACKAGES" "$DEBIAN_RELEASE" "$rootfs" "$MIRROR" \
    >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log" >&2; rm -f "$rootfs.log"; die "debootstrap failed"; }
  rm -f "$rootfs.log"
  # What only apt needs at install time, and the documentation.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/man/* \
    "$rootfs"/var/log/*.log "$rootfs"/var/log/apt/*
  mkdir -p "$PDPROC_COMPOSE_CACHE"
  tar --numeric-owner -C "$rootfs" -cf "$TARBALL.tmp" .
  mv "$TARBALL.tmp" "$TARBALL"
  log "cached $TARBALL ($(du -h "$TARBALL" | cut -f1))"
fi

if "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  log "$BASE_IMAGE is already in the engine"
else
  "$DOCKER" import --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'CMD ["/bin/bash"]' "$TARBALL" "$BASE_IMAGE" >/dev/null
  log "imported $BASE_IMAGE"
fi
