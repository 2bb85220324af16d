#!/usr/bin/env bash
# One prepared GPU run (H100/H200): DiT-XL/2 at 256 px in bf16, training-step MFU at several batch sizes per
# device, with and without torch.compile and activation checkpointing, SDPA's flash and cuDNN kernels side
# by side, then sampling throughput. MFU is against the datasheet peak, so no matmul probes (--peak-probe 0).
#
# Each configuration runs in its own process: compile sees one static shape, a crash (out of memory) costs
# that configuration only, and the script goes on to the next. A configuration that dit-cost's memory
# estimate says does not fit the device is skipped by benchmark.py, the reason in its row. Every process
# writes its own JSON as its row finishes: $OUT/gpu_bench_train_*.json, $OUT/gpu_bench_sample_*.json; the
# best training row becomes $OUT/calibration_xl2_256_bf16.json; $OUT/gpu_bench.txt has the tables and
# $OUT/gpu_bench_failed.txt the configurations whose process failed. Exit status 1 if any did.
# Needs only the core dependencies (torch, tensorboard, safetensors, pyyaml, tqdm; no diffusers: no VAE is used).
#   bash scripts/gpu_bench.sh                 # OUT defaults to results/gpu_bench
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu_bench}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
: >"$out/gpu_bench_failed.txt"

# one configuration in one process: config NAME scripts/benchmark.py MODE FLAGS...; a failure is recorded and
# the run goes on
config() {
    local name=$1
    shift 2
    echo "== $name"
    "$py" scripts/benchmark.py "$@" --out "$out/gpu_bench_$name.json"
    local rc=$?
    [ "$rc" -eq 0 ] || echo "$name: exit status $rc" | tee -a "$out/gpu_bench_failed.txt"
}

{
    echo "== device"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv || true
    "$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
    # eager
    config train_eager_b32 scripts/benchmark.py train --model DiT-XL/2 --precision bf16 --global-batch-size 32 --timed-steps 10 --untimed-steps 3 --peak-probe 0
    config train_eager_b64 scripts/benchmark.py train --model DiT-XL/2 --precision bf16 --global-batch-size 64 --timed-steps 10 --untimed-steps 3 --peak-probe 0
    config train_eager_b128 scripts/benchmark.py train --model DiT-XL/2 --precision bf16 --global-batch-size 128 --timed-steps 10 --untimed-steps 3 --peak-probe 0
    config train_eager_b256 scripts/benchmark.py train --model DiT-XL/2 --precision bf16 --global-batch-size 256 --timed-steps 10 --untimed-steps 3 --peak-probe 0
    # attention kernels at 128 images per device (eager)
    config train_attention_flash scripts/benchmark.py train --model DiT-XL/2 --precision bf16 --global-batch-size 128 --attention flash --timed-steps 10 --untimed-steps 3 --peak-probe 0
    config train_attention_cudnn scripts/benchmark.py train --model DiT-XL/2 --precision bf16 --global-batch-size 128 --attention cudnn --timed-steps 10 --untimed-steps 3 --peak-probe 0
    # compiled, with and without activation checkpointing
    config train_compiled_b128_none scripts/benchmark.py train --model DiT-XL/2 --precision bf16 --global-batch-size 128 --compile on --timed-steps 10 --untimed-steps 5 --peak-probe 0
    config train_compiled_b128_all scripts/benchmark.py train --model DiT-XL/2 --precision bf16 --global-batch-size 128 --compile on --activation-checkpointing all --timed-steps 10 --untimed-steps 5 --peak-probe 0
    config train_compiled_b256_none scripts/benchmark.py train --model DiT-XL/2 --precision bf16 --global-batch-size 256 --compile on --timed-steps 10 --untimed-steps 5 --peak-probe 0
    config train_compiled_b256_all scripts/benchmark.py train --model DiT-XL/2 --precision bf16 --global-batch-size 256 --compile on --activation-checkpointing all --timed-steps 10 --untimed-steps 5 --peak-probe 0
    echo "== calibration from the best training row"
    "$py" - "$out" <<'EOF' || echo "calibration: failed" | tee -a "$out/gpu_bench_failed.txt"
import glob, json, sys
from dit.cost.plan import Calibration, save_calibration

rows = [r for f in sorted(glob.glob(f"{sys.argv[1]}/gpu_bench_train_*.json")) for r in json.load(open(f))["rows"]]
usable = [r for r in rows if 0 < r.get("mfu", 0) <= 1]
if usable:
    best = max(usable, key=lambda r: r["mfu"])
    cal = Calibration(best["model"], best["image_size"], best["precision"], best["device"], best["mfu"])
    save_calibration(cal, f"{sys.argv[1]}/calibration_xl2_256_bf16.json", benchmark=best)
    print(f"best MFU {best['mfu']:.1%} (batch {best['batch_per_device']}, compile {best['compile']})")
else:
    print("no training row measured")
EOF
    # sampling, DiT-XL/2 256 px bf16, 50 DDPM steps, guidance 4 (latents only; VAE decode excluded)
    config sample_b64 scripts/benchmark.py sample --model DiT-XL/2 --precision bf16 --batch-size 64 --num-sampling-steps 50 --guidance-scale 4 --repeats 2
    config sample_b256 scripts/benchmark.py sample --model DiT-XL/2 --precision bf16 --batch-size 256 --num-sampling-steps 50 --guidance-scale 4 --repeats 2
} 2>&1 | tee "$out/gpu_bench.txt"
[ ! -s "$out/gpu_bench_failed.txt" ]
