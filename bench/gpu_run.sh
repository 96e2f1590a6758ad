#!/usr/bin/env bash
# The one command on the GPU machine (from the repo root, with .whl/ carried along):
#
#     bash bench/gpu_run.sh [gpu_check.py arguments]
#
# Installs the carried wheels (bench/gpu_wheels.sh) into /tmp/site without touching the network,
# then runs the first-contact checks (bench/first_contact.py: one line each; `--dry-run` runs only
# those, each up to its first GPU call, on a machine without one) and the check, writing bench/results/gpu-check-cuda.json as each section ends (correctness,
# timing, e2e, and tiers: the daemon's peak device memory against --tiers-budget and the H2D rate of
# an engine load from a page-locked host generation; `--skip correctness timing e2e` runs it alone). The steps
# are chained with ';', not '&&': a wheel that does not fit this machine still leaves the kernel
# and timing sections to run (gpu_check.py prints what it found and skips what needs the rest).
cd "$(dirname "$0")/.." || exit 1
if [ "${1:-}" = "--dry-run" ]; then
    # no GPU here: the first-contact checks, each up to its first call that needs a GPU (tests run this)
    exec python3 bench/first_contact.py --dry-run
fi
SITE=${SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl ;
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" ;
export PYTHONUNBUFFERED=1 ;
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv ;
# first contact (issue 34): one line per check of the seven CUDA-rule defects, a few minutes, bounded
timeout 420 python3 bench/first_contact.py --out bench/results/first-contact.json ;
python3 bench/gpu_check.py "$@"
