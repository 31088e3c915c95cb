#!/usr/bin/env bash
# Every check that needs a CUDA device, in one run: the gpu-marked tests and
# the CUDA export benchmark. Meant for a borrowed GPU machine that has torch
# with CUDA but no .venv (it runs the checkout in place through PYTHONPATH).
#   scripts/gpu_checks.sh [OUTDIR]      (OUTDIR: default $OUT, else ./gpu-out)
# A lent device returns what lands in $OUT, 8 files at most: this writes 7. Its
# steps' time limits add up to 420 s (one device command may take 600 s, and
# the whole loan is 15 minutes): run it with a timeout of about 540 s.
set -uo pipefail
out=${1:-${OUT:-gpu-out}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HURRAY_VLLM_CACHE_DIR=${HURRAY_VLLM_CACHE_DIR:-/tmp/hurray-vllm-cache}
# The benchmarks pin malloc's mmap threshold by restarting themselves (scripts/_bench.py): set here, no
# restart happens, which the profile below needs (a restart would leave cProfile behind).
export MALLOC_MMAP_THRESHOLD_=131072
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
    nproc
} 2>&1 | tee "$out/machine.txt"
rc=0
# Every gpu-marked test of the suite; those needing a package the device lacks (vLLM, flash-attn,
# FlashInfer, FlashMLA, NIXL) skip with the reason.
timeout 180 "$py" -m pytest -q -p no:cacheprovider -p no:randomly -m gpu tests/ 2>&1 | tee "$out/gpu_tests.log" || rc=1
# tiny: the default batch structure with almost no bytes (1 KV head of dimension 8), i.e. the
# export's CPU cost per call, which bounds the default configuration (docs/benchmarks.md).
for spec in "default:60:--layouts nhd,cpu-vec" "large:90:--layouts nhd --pool-mib 4096 --export-mib 1024 --layers 32" \
    "tiny:30:--layouts nhd --kv-heads 1 --head-dim 8 --pool-mib 4 --export-mib 1"; do
    name=${spec%%:*}
    rest=${spec#*:}
    limit=${rest%%:*}
    # shellcheck disable=SC2086  # the options are meant to split
    timeout "$limit" "$py" scripts/bench_export.py --device cuda --repeat 9 ${rest#*:} \
        >"$out/bench_export_cuda_$name.json" 2>>"$out/bench.err" || rc=1
    grep -h '"export_bandwidth_vs_pinned_d2h"\|"gb_per_s"' -A3 "$out/bench_export_cuda_$name.json" | head -20
done
# Where the CPU time of a default CUDA export goes (the next thing to cut there).
timeout 60 "$py" -m cProfile -s tottime scripts/bench_export.py --device cuda --repeat 5 --layouts nhd \
    2>>"$out/bench.err" | grep -A45 "Ordered by" >"$out/profile_cuda_export.txt" || rc=1
[ -s "$out/profile_cuda_export.txt" ] || { echo "no profile came out (see bench.err)" >&2; rc=1; }
exit $rc
