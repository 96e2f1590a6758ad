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
source "$(dirname "$0")/engine_venv.sh"  # engine_venv_open, engine_wheel_install

ENGINES_VENV=${ENGINES_VENV:-.venv-engines}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
VLLM_WHEEL_DIR=${VLLM_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/refitd/wheels}

stamp="$ENGINES_VENV/.installed-vllm-$VLLM_VERSION"
engine_venv_open setup_engines "$ENGINES_VENV" "$stamp"
engine_wheel_install vllm "$VLLM_VERSION" "$VLLM_WHEEL_DIR"
mapfile -t deps < <("$py" - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["vllm-reload-test"]))
PY
)
"$py" -m pip install -q "${deps[@]}"
mapfile -t nodeps < <("$py" - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["tool"]["refitd"]["vllm-model-test-nodeps"]))
PY
)
"$py" -m pip install -q --no-deps "${nodeps[@]}"
cp tests/engines/refitd_torchvision_shim.py "$site/"
echo "import refitd_torchvision_shim" > "$site/refitd-torchvision-shim.pth"
# the wheel's vllm._C is built for its own torch; vLLM logs that and the pure-Python reload path works
check="import vllm.model_executor.model_loader.reload, vllm.model_executor.model_loader.utils, torchvision"
VLLM_TARGET_DEVICE=cpu "$py" -c "$check" 2>/dev/null || {
    echo "setup_engines: vllm $VLLM_VERSION's reload package or model loader does not import in $ENGINES_VENV" >&2
    VLLM_TARGET_DEVICE=cpu "$py" -c "$check"
    exit 1
}
touch "$stamp"
