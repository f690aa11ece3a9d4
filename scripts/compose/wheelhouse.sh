#!/usr/bin/env bash
# The wheelhouse an offline image build installs from: the pdproc and pdproc-sim wheels of
# $DIST (what `make dist` built and `make test` tested) plus a wheel of every dependency, for
# the image's Python and platform (not the host's): CPython $IMAGE_PYTHON on glibc
# $IMAGE_GLIBC (Debian bookworm: 3.11, 2.36). The only network use of the whole image build:
# run it where PyPI (or your mirror, pip's usual settings) is reachable, then copy the folder
# to the air-gapped machine.
#
#   scripts/compose/wheelhouse.sh [DIST [OUT]]     (defaults: dist build/wheelhouse)
set -euo pipefail
. "$(dirname "$0")/lib.sh"

DIST=${1:-dist}
OUT=${2:-build/wheelhouse}
PYTHON=${PYTHON:-python3}
IMAGE_PYTHON=${IMAGE_PYTHON:-3.11}
IMAGE_GLIBC=${IMAGE_GLIBC:-2.36}
ARCH=${IMAGE_ARCH:-$(uname -m)}

shopt -s nullglob
wheels=("$DIST"/pdproc-*.whl "$DIST"/pdproc_sim-*.whl)
[ ${#wheels[@]} -eq 2 ] || die "need one pdproc and one pdproc-sim wheel in $DIST (make dist), found: ${wheels[*]:-none}"

# Every manylinux tag the image's glibc runs: manylinux_2_<glibc>..manylinux_2_17 and the
# legacy aliases (manylinux2014 = 2_17, manylinux2010 = 2_12, manylinux1 = 2_5).
platforms=()
for minor in $(seq "${IMAGE_GLIBC#2.}" -1 5); do platforms+=(--platform "manylinux_2_${minor}_$ARCH"); done
platforms+=(--platform "manylinux2014_$ARCH" --platform "manylinux2010_$ARCH" --platform "manylinux1_$ARCH")

rm -rf "$OUT"
mkdir -p "$OUT"
cp "${wheels[@]}" "$OUT/"
log "wheelhouse $OUT: dependencies of ${wheels[*]##*/} for CPython $IMAGE_PYTHON, glibc $IMAGE_GLIBC, $ARCH"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --dest "$OUT" \
  --only-binary=:all: --implementation cp --python-version "$IMAGE_PYTHON" \
  --abi "cp${IMAGE_PYTHON/./}" "${platforms[@]}" "${wheels[@]}" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
log "wheelhouse $OUT: $(ls "$OUT" | wc -l) wheels, $(du -sh "$OUT" | cut -f1)"
