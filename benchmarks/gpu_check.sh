#!/usr/bin/env bash
# The GPU check of one CUDA machine as its image is: the system python3 and its torch, PYTHONPATH=. (nothing is
# installed from a network), the Python packages the image lacks taken from wheels brought along in .gpu_wheels/
# (pure-Python, a few KB: `make gpu-wheels` fetches them). benchmarks/gpu_check.py says what each phase measures;
# its log, its JSON summary and planner.txt go to $OUT (default ./gpu_check_out).
#
#   OUT=$OUT bash benchmarks/gpu_check.sh                       # on the GPU machine (about 7 minutes)
#   DEVICE=cpu PRESET=debug bash benchmarks/gpu_check.sh        # the dry run of the same plumbing on a CPU
#
# Knobs (environment): DEVICE, PRESET, SEQ, BATCH, BUDGET, PHASES, COMPILE, KEEP, PY (gpu_check.py's docstring);
# WHEELS, the folder of wheels to bring along (default .gpu_wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PY OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT"
wheels=()
if [[ -d ${WHEELS:-.gpu_wheels} ]]; then wheels=("$(cd "${WHEELS:-.gpu_wheels}" && pwd)"/*.whl); fi
path=$PWD
if [[ ${#wheels[@]} -gt 0 && -e ${wheels[0]} ]]; then
    site=$(mktemp -d)
    if PIP_NO_INDEX=1 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "${wheels[@]}"; then
        path=$path:$site
    else # no pip: a pure-Python wheel imports as a zip
        echo "pip could not install ${wheels[*]}: putting the wheels themselves on PYTHONPATH"
        path=$path$(printf ':%s' "${wheels[@]}")
    fi
fi
export PYTHONPATH=$path${PYTHONPATH:+:$PYTHONPATH}
exec "$PY" -u benchmarks/gpu_check.py
