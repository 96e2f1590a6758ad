#!/usr/bin/env bash
# Set up .venv-sglang for `make test-sglang`: SGLang's real model classes and weight updater on CPU.
#
# Like tests/setup_engines.sh (vLLM; the steps both take are tests/engine_venv.sh): a separate venv
# that sees the project venv's packages (torch 2.13 CPU, Triton, pyzmq, pytest: one .pth line) and
# adds the SGLang wheel installed with --no-deps (its CUDA torch 2.14.1, flashinfer, sgl-kernel,
# DeepGEMM etc. are not installed) plus the light packages `import sglang` and its model/loader
# modules need (pyproject's `sglang-test` extra), and verl's wheel --no-deps with `sglang-verl-test`. SGLang pins torch 2.14.1; its loader and model code
# run on the CPU torch 2.13 of .venv, so no torch is installed here at all (never a CUDA one). The
# wheel is downloaded once into $SGLANG_WHEEL_DIR and reused.
set -euo pipefail
source "$(dirname "$0")/engine_venv.sh"  # the engine_* steps every setup_*.sh takes

SGLANG_VENV=${SGLANG_VENV:-.venv-sglang}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
SGLANG_WHEEL_DIR=${SGLANG_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/refitd/wheels}

engine_venv_open setup_sglang "$SGLANG_VENV" "$SGLANG_VENV/.installed-sglang-$SGLANG_VERSION"
engine_wheel_install sglang "$SGLANG_VERSION" "$SGLANG_WHEEL_DIR"
# --no-deps: each of these is listed with what it needs; nothing may pull a torch (a CUDA one)
engine_install_list --no-deps project optional-dependencies sglang-test
# verl's classes for tests/test_integration_verl_sglang.py (its manager over SGLang replicas): the wheel
# and what its checkpoint-engine, config and replica modules import, all --no-deps (no engine, no torch)
engine_wheel_install verl "${VERL_VERSION:-0.9.1}" "$SGLANG_WHEEL_DIR"
rm -rf "$site/tests"  # verl's wheel ships a top-level `tests` package: it would shadow refitd's tests/
engine_install_list --no-deps project optional-dependencies sglang-verl-test
engine_refuse_cuda
engine_check_import "import tests.support.sglang_cpu as s; s.import_sglang()" "sglang $SGLANG_VERSION's loader"
engine_check_import "import tests.support.sglang_cpu as s; s.import_sglang(); import verl.checkpoint_engine.base, verl.workers.rollout.replica" \
    "verl's checkpoint engine and replica (after SGLang's CPU shims)"
engine_venv_done
