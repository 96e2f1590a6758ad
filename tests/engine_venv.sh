# Sourced by tests/setup_engines.sh (vLLM) and tests/setup_sglang.sh (SGLang): what setting up an
# engine's venv for its real code on CPU always takes. The venv sees the project venv's packages
# (torch, pyzmq, pytest: one .pth line, after the venv's own); the engine's wheel is installed with
# --no-deps (its CUDA torch, flashinfer etc. are never installed), downloaded once into a wheel cache
# and reused; the light packages it imports are lists in pyproject.toml.

BASE_VENV=${BASE_VENV:-.venv}

# engine_venv_open WHO VENV STAMP: exit 0 (the calling script) when STAMP is newer than
# pyproject.toml and the setup scripts; else make VENV over $BASE_VENV and set py and site
engine_venv_open() {
    local who=$1 venv=$2 stamp=$3 base_py base_site
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
