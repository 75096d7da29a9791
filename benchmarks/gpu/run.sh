#!/usr/bin/env bash
# The GPU suite in one command (benchmarks/gpu/README.md):
#
#   bash benchmarks/gpu/run.sh OUT_DIR            # on a GPU machine: about 8 minutes
#   bash benchmarks/gpu/run.sh OUT_DIR --smoke    # every stage at tiny sizes on CPU (CI)
#
# Other arguments go to suite.py (--only STAGES, --budget STAGE=SECONDS); $PYTHON, if set, is
# the interpreter (default python3). It installs the wheels carried in .whl/ (built by
# wheels.sh where pip works: the GPU machine has no network) into a folder on PYTHONPATH, puts
# this checkout's d9d first on PYTHONPATH, then runs suite.py with its output unbuffered and
# copied to OUT_DIR/run.log as it comes, so a run cut off from outside still leaves its log.
set -uo pipefail
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: bash benchmarks/gpu/run.sh OUT_DIR [--smoke] [--only STAGES] [--budget STAGE=SECONDS]" >&2
    exit 2
fi
out="$1"
shift
repo="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
log="$out/run.log"
export PYTHONUNBUFFERED=1
{
    echo "d9d GPU suite: $(date -u +%FT%TZ) on ${HOSTNAME:-unknown host}, checkout $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    shopt -s nullglob
    wheels=("$repo"/.whl/*.whl)
    if [[ " $* " == *" --smoke "* ]]; then
        echo "smoke run: the carried wheels (for the GPU machine's Python) are not installed"
    elif [ ${#wheels[@]} -gt 0 ]; then
        site="${D9D_GPU_SITE:-/tmp/d9d-gpu-site}"
        echo "installing ${#wheels[@]} carried wheels into $site"
        install=("${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile
                 --disable-pip-version-check --root-user-action=ignore --target "$site")
        if ! "${install[@]}" "${wheels[@]}"; then
            echo "WARNING: installing them together failed; one by one:"
            for wheel in "${wheels[@]}"; do
                "${install[@]}" --upgrade "$wheel" || echo "WARNING: not installed: $wheel"
            done
        fi
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "no wheels in $repo/.whl (benchmarks/gpu/wheels.sh): using what this Python has"
    fi
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
    "${PYTHON:-python3}" "$repo/benchmarks/gpu/suite.py" "$out" "$@"
} 2>&1 | tee -a "$log"
exit "${PIPESTATUS[0]}"
