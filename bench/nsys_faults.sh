#!/usr/bin/env bash
# Runs the BERT example under Nsight Systems with unified-memory page-fault tracing, exports the
# report to SQLite and converts it to the counters table of `train.py --profile`
# (um_alloc/profile/nsys.py): OUT/nsys_faults.csv and OUT/nsys_faults.md.
#
#   bench/nsys_faults.sh OUT_DIR NAME [TRAIN_ARGS...]
#   bench/nsys_faults.sh runs/nsys best --policy best.yaml --batch-size 8 --steps 10
#
# nsys is not installed on our GPU machines: there, use `train.py --profile` (CUPTI, in process)
# or bench/compare_policies.py. nvprof is no substitute: it does not support devices of
# compute capability 8.0 and newer (Ampere, Hopper). nsys and --profile both need CUPTI, which
# serves one profiler per process, so --profile and --timeline are refused here.
set -euo pipefail

usage() { echo "usage: $0 OUT_DIR NAME [TRAIN_ARGS...]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
out=$1 name=$2
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)

if ! command -v nsys >/dev/null 2>&1; then
    echo "nsys_faults.sh: nsys is not on PATH. Install Nsight Systems, or measure in process instead:" >&2
    echo "  python $root/bert_example/train.py --profile $*" >&2
    exit 2
fi
for arg in "$@"; do
    if [[ $arg == --profile || $arg == --timeline* ]]; then
        echo "nsys_faults.sh: drop $arg: CUPTI serves one profiler per process and nsys is using it" >&2
        exit 2
    fi
done

mkdir -p "$out"
nsys profile --trace=cuda --cuda-um-gpu-page-faults=true --cuda-um-cpu-page-faults=true \
    --force-overwrite=true --output="$out/$name" \
    python "$root/bert_example/train.py" "$@" --json "$out/$name.summary.json"
nsys export --type=sqlite --force-overwrite=true --output="$out/$name.sqlite" "$out/$name.nsys-rep"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" python -m um_alloc.profile.nsys "$out/$name.sqlite" \
    --name "$name" --out "$out"
