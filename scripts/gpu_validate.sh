#!/usr/bin/env bash
# The GPU validation run, inside 420 s of one H200: the tests marked cuda (tests/test_gpu_*.py: what train.py
# runs on the device, checked, each under its own limit), then the benchmark rows (scripts/benchmark.py, DiT-XL/2
# bf16: batch 128 eager and compiled, batch 256 compiled with every block checkpointed, sampling), a process each.
#   bash scripts/gpu_validate.sh --out DIR [--dry-run]
# DIR receives gpu_validate.json (each test's outcome, seconds and figures, rewritten as each ends),
# gpu_validate.log (pytest's and the benchmarks' output) and bench_*.json (benchmark.py's rows); the compile
# cache and every temporary file live in a scratch folder under ${TMPDIR:-/tmp}, removed at the end. --dry-run
# runs the same on the CPU with tiny shapes (DIT_GPU_DRY_RUN=1; the CUDA-only parts skipped, with the reason).
# Exit status 0 when every test passed (or was skipped) and every row ran, 1 otherwise, 2 on bad use.
set -uo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
out="" dry=0
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=${2:?}; shift 2 ;;
        --dry-run) dry=1; shift ;;
        *) echo "error: unknown argument '$1': use --out DIR [--dry-run]" >&2; exit 2 ;;
    esac
done
if [ -z "$out" ]; then
    echo "error: no --out DIR: name the folder the results come back in (on the device machine, \"\$OUT\")" >&2
    exit 2
fi
case $out in /*) ;; *) out=$caller/$out ;; esac  # a relative --out is the caller's, not the repository's
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DIT_GPU_RESULTS=$out/gpu_validate.json
if [ $dry = 0 ] && ! "$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "error: no CUDA device here: run it on a GPU machine, or pass --dry-run to check the script on the CPU" >&2
    exit 2
fi
# Seconds: pytest's whole run (the tests' own limits, in their cuda markers, and its start), then each row's (a
# cold interpreter, its steps, its compiles); docs/performance.md, "GPU validation". The dry run's are for two
# shared CPU cores.
if [ $dry = 1 ]; then
    export DIT_GPU_DRY_RUN=1
    pytest_limit=4200 train=(--model DiT-S/8 --image-size 64 --timed-steps 2 --peak-probe 0 --peak-tflops 1) small=2 large=4
    sample=(--model DiT-S/8 --image-size 64 --batch-size 2 --num-sampling-steps 2 --repeats 1 --peak-tflops 1)
else
    pytest_limit=242 train=(--model DiT-XL/2 --timed-steps 8 --peak-probe 0) small=128 large=256
    sample=(--model DiT-XL/2 --batch-size 64 --num-sampling-steps 50 --guidance-scale 4 --repeats 2)
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_validate.XXXXXX") || exit 2
trap 'rm -rf "$work"' EXIT
# One compile cache for the tests and the rows: a graph compiled once is loaded, not compiled, by the next.
export TORCHINDUCTOR_CACHE_DIR=$work/inductor TRITON_CACHE_DIR=$work/triton TMPDIR=$work/tmp
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
mkdir -p "$out" "$work/tmp" || exit 2
rm -f "$out"/gpu_validate.json "$out"/gpu_validate.log "$out"/bench_*.json
log=$out/gpu_validate.log failed=0
timeout -k 5 $pytest_limit "$py" -m pytest -m cuda tests/test_gpu_device.py tests/test_gpu_train.py \
    -p no:cacheprovider --capture=sys -rfEs >"$log" 2>&1 || failed=1

# row NAME GPU_SECONDS DRY_SECONDS MODE FLAGS...: scripts/benchmark.py in its own process (compile sees one
# static shape; a crash costs one row), its rows in DIR/bench_NAME.json
row() {
    local name=$1 limit=$2
    [ $dry = 1 ] && limit=$3
    shift 3
    echo "== $name" >>"$log"
    timeout -k 2 "$limit" "$py" scripts/benchmark.py "$@" --precision bf16 --out "$out/bench_$name.json" >>"$log" 2>&1 \
        || { echo "$name: exit status $?" >>"$log"; failed=1; }
}
row train_b${small}_eager 20 600 train "${train[@]}" --global-batch-size $small --compile off --untimed-steps 2
row train_b${small}_compiled 35 900 train "${train[@]}" --global-batch-size $small --compile on --untimed-steps 3
row train_b${large}_compiled_checkpointed 35 900 train "${train[@]}" --global-batch-size $large --compile on \
    --activation-checkpointing all --untimed-steps 3
row sample 25 300 sample "${sample[@]}"
echo "results: $out/gpu_validate.json, $out/bench_*.json; log: $log"
exit $failed
