#!/usr/bin/env bash
# Every check that needs a CUDA device, in one run: the gpu-marked tests and
# the CUDA export benchmark. Meant for a borrowed GPU machine that has torch
# with CUDA but no .venv (it runs the checkout in place through PYTHONPATH).
#   scripts/gpu_checks.sh [OUTDIR]      (logs and JSON land in OUTDIR, default ./gpu-out)
set -uo pipefail
out=${1:-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HURRAY_VLLM_CACHE_DIR=${HURRAY_VLLM_CACHE_DIR:-/tmp/hurray-vllm-cache}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
    nproc
} 2>&1 | tee "$out/machine.txt"
rc=0
timeout 240 "$py" -m pytest -q -p no:cacheprovider -m gpu tests/kv/test_gpu_repage.py tests/adapters/test_gpu_kernels_*.py tests/adapters/vllm/test_gpu_export.py tests/adapters/test_reference.py 2>&1 | tee "$out/gpu_tests.log" || rc=1
# tiny: the default batch structure with almost no bytes (1 KV head of dimension 8), i.e. the
# export's CPU cost per call, which bounds the default configuration (docs/benchmarks.md).
for spec in "default:--layouts nhd,cpu-vec" "large:--layouts nhd --pool-mib 4096 --export-mib 1024 --layers 32" \
    "tiny:--layouts nhd --kv-heads 1 --head-dim 8 --pool-mib 4 --export-mib 1"; do
    name=${spec%%:*}
    # shellcheck disable=SC2086  # the options are meant to split
    timeout 180 "$py" scripts/bench_export.py --device cuda --repeat 9 ${spec#*:} \
        >"$out/bench_export_cuda_$name.json" 2>"$out/bench_export_cuda_$name.err" || rc=1
    grep -h '"export_bandwidth_vs_pinned_d2h"\|"gb_per_s"' -A3 "$out/bench_export_cuda_$name.json" | head -20
done
# Where the CPU time of a default CUDA export goes (the next thing to cut there).
timeout 120 "$py" -m cProfile -s tottime scripts/bench_export.py --device cuda --repeat 5 --layouts nhd \
    2>"$out/profile_cuda_export.err" | grep -A45 "Ordered by" >"$out/profile_cuda_export.txt" || rc=1
exit $rc
