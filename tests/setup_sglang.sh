#!/usr/bin/env bash
# Set up .venv-sglang for `make test-sglang`: SGLang's real model classes and weight updater on CPU.
#
# Like tests/setup_engines.sh (vLLM; the steps both take are tests/engine_venv.sh): a separate venv
# that sees the project venv's packages (torch 2.13 CPU, Triton, pyzmq, pytest: one .pth line) and
# adds the SGLang wheel installed with --no-deps (its CUDA torch 2.14.1, flashinfer, sgl-kernel,
# DeepGEMM etc. are not installed) plus the light packages `import sglang` and its model/loader
# modules need (pyproject's `sglang-test` extra). SGLang pins torch 2.14.1; its loader and model code
# run on the CPU torch 2.13 of .venv, so no torch is installed here at all (never a CUDA one). The
# wheel is downloaded once into $SGLANG_WHEEL_DIR and reused.
set -euo pipefail
source "$(dirname "$0")/engine_venv.sh"  # engine_venv_open, engine_wheel_install, pyproject_list

SGLANG_VENV=${SGLANG_VENV:-.venv-sglang}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
SGLANG_WHEEL_DIR=${SGLANG_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/refitd/wheels}

stamp="$SGLANG_VENV/.installed-sglang-$SGLANG_VERSION"
engine_venv_open setup_sglang "$SGLANG_VENV" "$stamp"
engine_wheel_install sglang "$SGLANG_VERSION" "$SGLANG_WHEEL_DIR"
mapfile -t deps < <(pyproject_list project optional-dependencies sglang-test)
# --no-deps: each of these is listed with what it needs; nothing may pull a torch (a CUDA one)
"$py" -m pip install -q --no-deps "${deps[@]}"
own=$("$py" -m pip list --path "$site" --format=freeze 2>/dev/null)
bad=$(grep -iE '^(torch|nvidia-cu[a-z]*-cu[0-9]+|nvidia-cublas.*|flashinfer.*|sgl-kernel|sglang-kernel)==' <<<"$own" || true)
if [ -n "$bad" ]; then
    echo "setup_sglang: $SGLANG_VENV must use .venv's CPU torch and no CUDA packages; remove: $bad" >&2
    exit 1
fi
"$py" -c "import tests.support.sglang_cpu as s; s.import_sglang()" || {
    echo "setup_sglang: sglang $SGLANG_VERSION's loader does not import in $SGLANG_VENV (above)" >&2
    exit 1
}
touch "$stamp"
