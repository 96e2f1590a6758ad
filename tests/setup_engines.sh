#!/usr/bin/env bash
# Set up .venv-engines for `make test-engines`: vLLM's real reload code on CPU, without CUDA.
#
# A separate venv that sees the project venv's packages (torch, pyzmq, pytest: one .pth line) and adds
# the vLLM wheel installed with --no-deps (its CUDA torch, flashinfer etc. are not installed) plus the
# light packages vLLM's reload package imports (pyproject's `vllm-reload-test` extra). The 336 MB wheel
# is downloaded once into $VLLM_WHEEL_DIR and reused. For vLLM's real model classes
# (tests/test_engine_vllm_models.py): compressed-tensors and torchvision with --no-deps (they would
# pull a CUDA torch; pyproject's `vllm-model-test-nodeps` list), and the torchvision::nms schema shim
# (tests/engines/refitd_torchvision_shim.py, imported by a .pth line in every process of the venv).
set -euo pipefail
source "$(dirname "$0")/engine_venv.sh"  # the engine_* steps every setup_*.sh takes

ENGINES_VENV=${ENGINES_VENV:-.venv-engines}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
VLLM_WHEEL_DIR=${VLLM_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/refitd/wheels}

engine_venv_open setup_engines "$ENGINES_VENV" "$ENGINES_VENV/.installed-vllm-$VLLM_VERSION"
engine_wheel_install vllm "$VLLM_VERSION" "$VLLM_WHEEL_DIR"
engine_install_list project optional-dependencies vllm-reload-test
engine_install_list --no-deps tool refitd vllm-model-test-nodeps
cp tests/engines/refitd_torchvision_shim.py "$site/"
echo "import refitd_torchvision_shim" > "$site/refitd-torchvision-shim.pth"
# the wheel's vllm._C is built for its own torch; vLLM logs that and the pure-Python reload path works
VLLM_TARGET_DEVICE=cpu engine_check_import \
    "import vllm.model_executor.model_loader.reload, vllm.model_executor.model_loader.utils, torchvision" \
    "vllm $VLLM_VERSION's reload package or model loader"
engine_venv_done
