#!/usr/bin/env bash
# The GPU validation run (issue 33): every CUDA path checked and measured in at most 10 minutes of one H200.
#   bash scripts/gpu_validate.sh [--out DIR] [--dry-run] [--fail SECTION]
# Sections, each in its own process under its own timeout, the next one run whatever the last did:
#   env       nvidia-smi, torch/CUDA versions, dit-cost's datasheet peak for the device
#   flags     TF32 and the legacy getters inside Precision(...).flags() for each precision; a compiled matmul
#   numerics  one XL/2 block eager / compiled / checkpointed (fp32, bf16; outputs and gradients) and every SDPA
#             backend, against float64; recompiles and graph breaks (TORCH_LOGS) in the record
#   sync      set_sync_debug_mode("warn") over three train_steps (none expected); a NaN batch changes nothing
#   bench     scripts/benchmark.py train, DiT-XL/2 bf16 at the batches that fit, compile off and on, a process each
#   e2e       train.py from a synthetic latent store: 20 steps and a save, then --resume auto to 40 (ledger MFU vs
#             the benchmark, max_memory_reserved vs dit-cost memory, save time)
#   sample    scripts/benchmark.py sample, DiT-XL/2 bf16, 50 DDPM steps, guidance 4
# Each section writes DIR/sections/NAME.json as it ends (bench also DIR/bench.jsonl, a row at a time) and its
# output to DIR/logs/NAME.log; after each, DIR/gpu_validate.json gathers the records so far. --dry-run runs
# every section on the CPU with tiny shapes (the CUDA-only parts recorded as skipped); --fail SECTION makes that
# section fail (to see the others still run). Exit status 0 when every section is ok, 1 otherwise, 2 on bad use.
set -uo pipefail
cd "$(dirname "$0")/.."
out=results/gpu_validate dry=0 fail=""
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=${2:?}; shift 2 ;;
        --dry-run) dry=1; shift ;;
        --fail) fail=${2:?}; shift 2 ;;
        *) echo "error: unknown argument '$1': use [--out DIR] [--dry-run] [--fail SECTION]" >&2; exit 2 ;;
    esac
done
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ $dry = 0 ] && ! "$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "error: no CUDA device here: run it on a GPU machine, or pass --dry-run to check the script on the CPU" >&2
    exit 2
fi
# seconds per section: 550 in all on the GPU, 585 with the 5 s each may take to die when killed; the dry run's
# are for two shared CPU cores
if [ $dry = 1 ]; then
    flag=(--dry-run) limits=(env:60 flags:120 numerics:180 sync:120 bench:180 e2e:180 sample:120)
else
    flag=() limits=(env:20 flags:40 numerics:110 sync:35 bench:190 e2e:120 sample:35)
fi
case " ${limits[*]} " in
    *" $fail:"* | "  ") ;;
    *) [ -z "$fail" ] || { echo "error: --fail $fail: not a section (${limits[*]%%:*})" >&2; exit 2; } ;;
esac
mkdir -p "$out/sections" "$out/logs"
rm -f "$out"/sections/*.json "$out/gpu_validate.json"
failed=0
for entry in "${limits[@]}"; do
    name=${entry%%:*} limit=${entry#*:}
    extra=()
    [ "$name" = "$fail" ] && extra=(--fail)
    logs=()
    [ "$name" = numerics ] && logs=(TORCH_LOGS=recompiles,graph_breaks)
    start=$(date +%s%N)
    env "${logs[@]}" timeout -k 5 "$limit" "$py" scripts/gpu_validate.py "$name" --out "$out" --budget "$limit" \
        "${flag[@]}" "${extra[@]}" >"$out/logs/$name.log" 2>&1
    rc=$?
    ms=$((($(date +%s%N) - start) / 1000000))
    seconds=$((ms / 1000)).$(printf %03d $((ms % 1000)))
    "$py" scripts/gpu_validate.py finish "$name" --out "$out" --rc $rc --seconds "$seconds" "${flag[@]}"
    status=$("$py" -c "import json, sys; print(json.load(open(sys.argv[1]))['status'])" "$out/sections/$name.json")
    printf '%-9s %-8s %8s s\n' "$name" "$status" "$seconds"
    [ "$status" = ok ] || failed=1
done
echo "records: $out/gpu_validate.json"
exit $failed
