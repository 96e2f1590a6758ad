#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels bench/gpu_run.sh installs on the GPU machine, which has
# no network: pyzmq (missing there), msgpack, cuda-bindings and cuda-pathfinder, built for its
# Python (3.12, x86_64 manylinux). Run on a machine where pip works:
#
#     bench/gpu_wheels.sh            # or: make gpu-wheels
#
# CUDA_MAJOR picks the cuda-bindings major: it must not be newer than the GPU driver's CUDA major
# (nvidia-smi's "CUDA Version"; the H200 image's driver 580 is CUDA 13). PYTHON_VERSION and DEST
# can be overridden too. One version of each package: two would stop the whole install there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
CUDA_MAJOR=${CUDA_MAJOR:-13}
DEST=${DEST:-.whl}
case "$CUDA_MAJOR" in
    12) BINDINGS='cuda-bindings>=12.6,<13' ;;
    13) BINDINGS='cuda-bindings>=13,<14' ;;
    *) echo "CUDA_MAJOR=$CUDA_MAJOR: refitd supports CUDA 12 or 13 drivers" >&2; exit 2 ;;
esac
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
    PLATFORMS+=(--platform "$p")
done
for req in 'pyzmq>=25' 'msgpack>=1.0' "$BINDINGS" 'cuda-pathfinder>=1.1'; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
        --implementation cp "${PLATFORMS[@]}" -d "$DEST" "$req"
done
ls -1 "$DEST"
du -sh "$DEST"
