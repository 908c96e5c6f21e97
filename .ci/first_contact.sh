#!/usr/bin/env bash
# The README's commands as a new user runs them: fresh virtual environments holding the built
# wheel with exactly the extras the README names, none of the dev or test tools. An import that
# the package makes but does not declare fails here (scipy in the analysis did once).
#   1. `.[all]`: `kvcouple demo` on the embedded model; the decomposition must be printed.
#   2. no extra: the analysis core (`kvcouple synth trace-store`, `kvcouple analyze --no-figures`).
# Usage: .ci/first_contact.sh WHEEL [all|core]...   (default: both)
set -euo pipefail
wheel=$(realpath "$1"); shift
jobs=("${@:-all core}")
PYTHON=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
root=build/first-contact
mkdir -p "$root"

fresh_venv() {  # fresh_venv NAME REQUIREMENT
    rm -rf "$root/$1"
    $PYTHON -m venv "$root/$1"
    "$root/$1/bin/pip" install -q "$2"
    # Nothing of the test or dev extras may have come along.
    if "$root/$1/bin/python" -c "import scipy" 2>/dev/null; then
        echo "$1: scipy is installed in the fresh environment: the check below proves nothing"
        exit 1
    fi
}

for job in ${jobs[*]}; do
    case "$job" in
    all)
        echo "-- fresh venv with kvcouple[all]: kvcouple demo"
        fresh_venv all "$wheel[all]"
        out="$root/all/demo-out"
        rm -rf "$out"
        "$root/all/bin/kvcouple" demo --quiet --out "$out" | tee "$root/all/demo.log"
        grep -q "E\[M\]/T" "$root/all/demo.log" || { echo "the demo printed no decomposition"; exit 1; }
        ls "$out"/run-*/report/report.html >/dev/null
        ;;
    core)
        echo "-- fresh venv with kvcouple (no extra): synth trace-store, analyze --no-figures"
        fresh_venv core "$wheel"
        bin="$root/core/bin"
        work="$root/core/work"
        rm -rf "$work" && mkdir -p "$work"
        "$bin/kvcouple" synth random-pair --vocab 12 --seed 1 --closeness 0.8 --out "$work/a.npz"
        "$bin/kvcouple" synth random-pair --vocab 12 --seed 2 --closeness 0.6 --out "$work/b.npz"
        "$bin/kvcouple" synth trace-store "A=$work/a.npz" "B=$work/b.npz" --out "$work/s.zarr" \
            -T 16 -R 16 -K 2 --docs 8 --quiet
        "$bin/kvcouple" analyze "$work/s.zarr" --out "$work/report" --no-figures --quiet \
            | tee "$work/analyze.log"
        grep -q "E\[M\]/T" "$work/analyze.log" || { echo "analyze printed no decomposition"; exit 1; }
        "$bin/python" -c "import sys, kvcouple.analysis; assert 'scipy' not in sys.modules"
        ;;
    *)
        echo "unknown job $job (all, core)"; exit 2 ;;
    esac
done
echo "first contact OK"
