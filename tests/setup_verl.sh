#!/usr/bin/env bash
# Set up .venv-verl for `make test-verl`: verl 0.9.1's real checkpoint-engine registry, config
# dataclasses and FSDP engine code on CPU, with refitd's verl backend (integrations/verl.py).
#
# Like tests/setup_sglang.sh (tests/engine_venv.sh holds the shared steps): a separate venv that sees
# the project venv's packages (torch 2.13 CPU, ray, pyzmq, pytest: one .pth line) and adds the verl
# wheel with --no-deps plus only the light packages verl's imported modules need (pyproject's
# `verl-test` extra, also --no-deps: nothing may pull a torch, never a CUDA one). verl 0.9.1 wants
# transformers <5.11, so this venv holds its own transformers in front of .venv's.
set -euo pipefail
source "$(dirname "$0")/engine_venv.sh"

VERL_VENV=${VERL_VENV:-.venv-verl}
VERL_VERSION=${VERL_VERSION:-0.9.1}
VERL_WHEEL_DIR=${VERL_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/refitd/wheels}

engine_venv_open setup_verl "$VERL_VENV" "$VERL_VENV/.installed-verl-$VERL_VERSION"
engine_wheel_install verl "$VERL_VERSION" "$VERL_WHEEL_DIR"
engine_install_list --no-deps project optional-dependencies verl-test
engine_refuse_cuda 'nvidia-[a-z0-9-]+|vllm|sglang'  # verl's extras would pull an engine: never here
engine_check_import "import verl.checkpoint_engine.base, verl.workers.engine.fsdp.transformer_impl" \
    "verl $VERL_VERSION's checkpoint engine or FSDP engine"
engine_venv_done
