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

BASE_VENV=${BASE_VENV:-.venv}
ENGINES_VENV=${ENGINES_VENV:-.venv-engines}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
VLLM_WHEEL_DIR=${VLLM_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/refitd/wheels}

base_py="$BASE_VENV/bin/python"
if [ ! -x "$base_py" ]; then
    echo "setup_engines: $base_py not found: run 'make venv' first" >&2
    exit 1
fi
stamp="$ENGINES_VENV/.installed-vllm-$VLLM_VERSION"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
    exit 0
fi

test -x "$ENGINES_VENV/bin/python" || "$base_py" -m venv "$ENGINES_VENV"
py="$ENGINES_VENV/bin/python"
base_site=$("$base_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$(cd "$base_site" && pwd)" > "$site/zz-refitd-base.pth"  # after the venv's own packages

wheel=$(ls "$VLLM_WHEEL_DIR"/vllm-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    mkdir -p "$VLLM_WHEEL_DIR"
    "$py" -m pip download -q --no-deps "vllm==$VLLM_VERSION" -d "$VLLM_WHEEL_DIR"
    wheel=$(ls "$VLLM_WHEEL_DIR"/vllm-"$VLLM_VERSION"-*.whl | head -n 1)
fi
"$py" -m pip install -q --no-deps "$wheel"
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
