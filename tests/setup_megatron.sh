#!/usr/bin/env bash
# Set up .venv-megatron for `make test-megatron`: real Megatron-Core 0.19.2 and Megatron-Bridge 0.6.2
# on the CPU (tests/test_megatron.py). They need Python >= 3.12 ($PYTHON312, else python3.12 on
# PATH, else pyenv's newest 3.12). The pinned packages are tests/megatron-nodeps.txt (--no-deps) and
# tests/megatron-deps.txt; refitd itself is imported from the checkout (PYTHONPATH). The CPU
# workarounds are listed in tests/support/megatron_cpu.py; the first, torch's CUDA libraries'
# stand-ins, is built here (tests/support/cuda_stubs.py, needs cc and readelf).
set -euo pipefail
cd "$(dirname "$0")/.."

source tests/engine_venv.sh  # engine_check_import, engine_venv_done (this venv has its own Python and torch)

VENV=${MEGATRON_VENV:-.venv-megatron}
who=setup_megatron venv=$VENV
stamp="$VENV/.installed-$(cat tests/megatron-nodeps.txt tests/megatron-deps.txt tests/support/cuda_stubs.py | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0

is312() { [ -n "$1" ] && "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; }
root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")  # pyenv's versions, not its shim
py312=""
for candidate in "${PYTHON312:-}" "$(command -v python3.12 || true)" $(ls -d "$root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -r); do
    if is312 "$candidate"; then py312=$candidate; break; fi
done
if [ -z "$py312" ]; then
    echo "setup_megatron: Megatron-Core 0.19 needs Python 3.12: set PYTHON312 to its interpreter" >&2
    exit 1
fi
rm -rf "$VENV"
"$py312" -m venv "$VENV"
py="$VENV/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q --no-deps -r tests/megatron-nodeps.txt
"$py" -m pip install -q -r tests/megatron-deps.txt
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$py" tests/support/cuda_stubs.py "$site"
PYTHONPATH=$PWD "$py" -m sidecar.numerics.native || true  # native CPU quantizers (the torch path if not)
PYTHONPATH=$PWD engine_check_import \
    "from tests.support.megatron_cpu import install; install(); import torch; assert not torch.cuda.is_available()" \
    "megatron.bridge (with tests/support/megatron_cpu.py)"
engine_venv_done
