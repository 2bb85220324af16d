#!/usr/bin/env bash
# One prepared GPU run (H100/H200): DiT-XL/2 at 256 px in bf16, training-step MFU at several batch sizes per
# device, with and without torch.compile and activation checkpointing, SDPA's flash and cuDNN kernels side
# by side, then sampling throughput. MFU is against the datasheet peak, so no matmul probes (--peak-probe 0).
# Writes $OUT/gpu_bench_train.json, $OUT/gpu_bench_sample.json and $OUT/gpu_bench.txt (the tables).
# Needs only the core dependencies (torch, tensorboard, safetensors, pyyaml, tqdm; no diffusers: no VAE is used).
#   bash scripts/gpu_bench.sh                 # OUT defaults to results/gpu_bench
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu_bench}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    echo "== device"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv || true
    "$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
    echo "== training step, DiT-XL/2 256 px bf16 (eager)"
    "$py" scripts/benchmark.py train --model DiT-XL/2 --precision bf16 --global-batch-size 32 64 128 256 \
        --activation-checkpointing none --timed-steps 10 --untimed-steps 3 --peak-probe 0 --out "$out/gpu_bench_train_eager.json"
    echo "== attention kernels at 128 images per device (eager)"
    "$py" scripts/benchmark.py train --model DiT-XL/2 --precision bf16 --global-batch-size 128 --attention flash cudnn \
        --timed-steps 10 --untimed-steps 3 --peak-probe 0 --out "$out/gpu_bench_train_attention.json"
    echo "== training step, compiled, with and without activation checkpointing"
    "$py" scripts/benchmark.py train --model DiT-XL/2 --precision bf16 --global-batch-size 128 256 \
        --activation-checkpointing none all --compile on --timed-steps 10 --untimed-steps 5 --peak-probe 0 \
        --out "$out/gpu_bench_train_compiled.json" \
        --calibration "$out/calibration_xl2_256_bf16.json"
    echo "== sampling, DiT-XL/2 256 px bf16, 50 DDPM steps, guidance 4 (latents only; VAE decode excluded)"
    "$py" scripts/benchmark.py sample --model DiT-XL/2 --precision bf16 --per-proc-batch-size 64 256 \
        --num-sampling-steps 50 --guidance-scale 4 --repeats 2 --out "$out/gpu_bench_sample.json"
} 2>&1 | tee "$out/gpu_bench.txt"
