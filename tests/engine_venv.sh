# Sourced by every tests/setup_*.sh that builds an engine's or framework's venv (vLLM: setup_engines.sh,
# SGLang: setup_sglang.sh, verl: setup_verl.sh; setup_megatron.sh, whose venv has its own Python 3.12
# and torch, uses only the import check and the stamp): what setting one up for its real code on CPU
# always takes. The venv sees the project venv's packages (torch 2.13 CPU, pyzmq, pytest: one .pth line, after the venv's own), so no
# torch is ever installed into it (never a CUDA one); the engine's wheel is installed with --no-deps,
# downloaded once into a wheel cache and reused; the light packages it imports are lists in
# pyproject.toml. A setup script is these steps in order:
#
#     source "$(dirname "$0")/engine_venv.sh"
#     engine_venv_open setup_x "$VENV" "$VENV/.installed-x-$VERSION"   # exits 0 when up to date
#     engine_wheel_install x "$VERSION" "$WHEEL_DIR"                   # the engine, --no-deps
#     engine_install_list --no-deps tool refitd x-nodeps               # pyproject lists (KEY path)
#     engine_refuse_cuda                                               # no torch / CUDA wheels came in
#     engine_check_import "import x.loader"                            # fails naming the venv
#     engine_venv_done                                                 # the stamp
#
# Every function reports as "$who: ..." and exits the calling script on failure.

BASE_VENV=${BASE_VENV:-.venv}

# engine_venv_open WHO VENV STAMP: exit 0 (the calling script) when STAMP is newer than
# pyproject.toml and the setup scripts; else make VENV over $BASE_VENV and set who, venv, stamp,
# py (the venv's python) and site (its site-packages) for the functions below
engine_venv_open() {
    who=$1 venv=$2 stamp=$3
    local base_py base_site
    base_py="$BASE_VENV/bin/python"
    if [ ! -x "$base_py" ]; then
        echo "$who: $base_py not found: run 'make venv' first" >&2
        exit 1
    fi
    if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt "$0" ] \
        && [ "$stamp" -nt "${BASH_SOURCE[0]}" ]; then
        exit 0
    fi
    test -x "$venv/bin/python" || "$base_py" -m venv "$venv"
    py="$venv/bin/python"
    base_site=$("$base_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$(cd "$base_site" && pwd)" > "$site/zz-refitd-base.pth"  # after the venv's own packages
}

# engine_wheel_install PACKAGE VERSION WHEEL_DIR: install PACKAGE's wheel with --no-deps, downloading
# it into WHEEL_DIR the first time
engine_wheel_install() {
    local package=$1 version=$2 dir=$3 wheel
    wheel=$(ls "$dir/$package-$version"-*.whl 2>/dev/null | head -n 1 || true)
    if [ -z "$wheel" ]; then
        mkdir -p "$dir"
        "$py" -m pip download -q --no-deps "$package==$version" -d "$dir"
        wheel=$(ls "$dir/$package-$version"-*.whl | head -n 1)
    fi
    "$py" -m pip install -q --no-deps "$wheel"
}

# pyproject_list KEY...: the list at KEY... of pyproject.toml, one item a line
pyproject_list() {
    "$py" - "$@" <<'PY'
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    value = tomllib.load(f)
for key in sys.argv[1:]:
    value = value[key]
print("\n".join(value))
PY
}

# engine_install_list [--no-deps] KEY...: pip install the pyproject.toml list at KEY... (e.g.
# `project optional-dependencies sglang-test`); --no-deps when each item lists what it needs
engine_install_list() {
    local flags=()
    if [ "${1:-}" = --no-deps ]; then
        flags=(--no-deps)
        shift
    fi
    local items
    mapfile -t items < <(pyproject_list "$@")
    "$py" -m pip install -q "${flags[@]}" "${items[@]}"
}

# engine_refuse_cuda [PATTERN]: fail when the venv's own site-packages holds a torch or a CUDA wheel (a
# dependency pulled one in): the venv must run on .venv's CPU torch. PATTERN (an extended regex of
# package names, e.g. 'vllm|sglang') names more packages this venv must not hold
engine_refuse_cuda() {
    local own bad names='torch|nvidia-cu[a-z]*-cu[0-9]+|nvidia-cublas.*|flashinfer.*|sgl-kernel|sglang-kernel'
    own=$("$py" -m pip list --path "$site" --format=freeze 2>/dev/null)
    bad=$(grep -iE "^($names${1:+|$1})==" <<<"$own" || true)
    if [ -n "$bad" ]; then
        echo "$who: $venv must use .venv's CPU torch and no CUDA packages; remove: $bad" >&2
        exit 1
    fi
}

# engine_check_import CODE [WHAT]: run CODE in the venv's python (quietly; again, loudly, on failure)
# and fail naming WHAT (default: the code). Set variables for it in the environment of the call, as
# in `VLLM_TARGET_DEVICE=cpu engine_check_import "import vllm"`.
engine_check_import() {
    local code=$1 what=${2:-$1}
    if ! "$py" -c "$code" 2>/dev/null; then
        "$py" -c "$code" || true
        echo "$who: $what does not import in $venv (above)" >&2
        exit 1
    fi
}

# engine_venv_done: write the stamp engine_venv_open checks, so the next run exits at once
engine_venv_done() {
    touch "$stamp"
}
