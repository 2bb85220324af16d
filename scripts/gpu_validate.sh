#!/usr/bin/env bash
# The GPU validation run: every CUDA path train.py takes, checked and measured inside 420 s of one H200.
#   bash scripts/gpu_validate.sh --out DIR [--dry-run] [--fail SECTION]
# Sections, each in its own process under its own timeout, the next one run whatever the last did:
#   env       nvidia-smi, torch/CUDA versions, dit-cost's datasheet peak for the device
#   flags     TF32 and the legacy getters inside Precision(...).flags() for each precision; a compiled matmul
#   numerics  one XL/2 block eager / compiled / checkpointed inside and compiled (the trainer's) / under an outer
#             checkpoint, against float64; every SDPA backend; recompiles and graph breaks in the record
#   sync      set_sync_debug_mode("warn") over three train_steps (none expected); a NaN batch changes nothing
#   parallel  the trainer's wrapping in a process group of one (NCCL): DDP bit for bit as one process, FSDP2
#             close to it, both over compiled blocks checkpointed inside; a DCP save and a bit-for-bit resume
#   bench     scripts/benchmark.py train, DiT-XL/2 bf16: batch 128 eager and compiled, batch 256 compiled with
#             every block checkpointed; a process each
#   e2e       train.py (compiled, checkpointed blocks) from a synthetic latent store: 20 steps, then a run
#             resumed from step 10 that must reach step 20's checkpoint bit for bit; the ledger's MFU
#   sample    scripts/benchmark.py sample, DiT-XL/2 bf16, 50 DDPM steps, guidance 4
# DIR receives two files, rewritten after each section: gpu_validate.json (every section's record) and
# logs.tar.gz (each section's log, its last MiB). Everything else (records, logs, stores, checkpoints, the one
# compile cache all sections share) lives in a scratch folder under ${TMPDIR:-/tmp}, removed at the end.
# --dry-run runs every section on the CPU with tiny shapes (the CUDA-only parts recorded as skipped); --fail
# SECTION makes that section fail (to see the others still run). Exit status 0 when every section is ok, 1
# otherwise, 2 on bad use.
set -uo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
out="" dry=0 fail=""
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=${2:?}; shift 2 ;;
        --dry-run) dry=1; shift ;;
        --fail) fail=${2:?}; shift 2 ;;
        *) echo "error: unknown argument '$1': use --out DIR [--dry-run] [--fail SECTION]" >&2; exit 2 ;;
    esac
done
if [ -z "$out" ]; then
    echo "error: no --out DIR: name the folder the results come back in (on the device machine, \"\$OUT\")" >&2
    exit 2
fi
case $out in /*) ;; *) out=$caller/$out ;; esac  # a relative --out is the caller's, not the repository's
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ $dry = 0 ] && ! "$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "error: no CUDA device here: run it on a GPU machine, or pass --dry-run to check the script on the CPU" >&2
    exit 2
fi
# Seconds per section. On the GPU: each section's work (its dry-run steps at full size, and a cold interpreter)
# plus its compile budget (docs/performance.md, "GPU validation"): 355 in all, 371 with the 2 s each may take
# to die, under the 420 s the run must fit. The dry run's are for two shared CPU cores.
if [ $dry = 1 ]; then
    flag=(--dry-run) limits=(env:60 flags:120 numerics:180 sync:120 parallel:600 bench:400 e2e:400 sample:120)
else
    flag=() limits=(env:20 flags:30 numerics:60 sync:25 parallel:55 bench:90 e2e:50 sample:25)
fi
case " ${limits[*]} " in
    *" $fail:"* | "  ") ;;
    *) [ -z "$fail" ] || { echo "error: --fail $fail: not a section (${limits[*]%%:*})" >&2; exit 2; } ;;
esac
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_validate.XXXXXX") || exit 2
trap 'rm -rf "$work"' EXIT
# One compile cache for every section: a graph one section compiled is loaded, not compiled, by the next. Every
# other temporary file of the sections (Inductor's precompiled headers among them) goes to the scratch too.
export TORCHINDUCTOR_CACHE_DIR=$work/inductor TRITON_CACHE_DIR=$work/triton TMPDIR=$work/tmp
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
mkdir -p "$out" "$work/sections" "$work/logs" "$work/tmp" || exit 2
rm -f "$out/gpu_validate.json" "$out/logs.tar.gz"
failed=0
for entry in "${limits[@]}"; do
    name=${entry%%:*} limit=${entry#*:}
    extra=()
    [ "$name" = "$fail" ] && extra=(--fail)
    logs=()
    [ "$name" = numerics ] && logs=(TORCH_LOGS=recompiles,graph_breaks)
    start=$(date +%s%N)
    env "${logs[@]}" timeout -k 2 "$limit" "$py" scripts/gpu_validate.py "$name" --work "$work" --budget "$limit" \
        "${flag[@]}" "${extra[@]}" >"$work/logs/$name.log" 2>&1
    rc=$?
    ms=$((($(date +%s%N) - start) / 1000000))
    seconds=$((ms / 1000)).$(printf %03d $((ms % 1000)))
    "$py" scripts/gpu_validate.py finish "$name" --work "$work" --out "$out" --rc $rc --seconds "$seconds" \
        "${flag[@]}"
    status=$("$py" -c "import json, sys; print(json.load(open(sys.argv[1]))['status'])" "$work/sections/$name.json")
    printf '%-9s %-8s %8s s\n' "$name" "$status" "$seconds"
    [ "$status" = ok ] || failed=1
done
echo "results: $out/gpu_validate.json, logs: $out/logs.tar.gz"
exit $failed
