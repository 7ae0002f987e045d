#!/usr/bin/env bash
# CUDA check for a machine with an NVIDIA GPU and no network (at most ~8 minutes).
#
# Uses the Python and CUDA build of torch found on the machine and the project source (nothing
# is installed: the project's dependencies must be importable already). The packaged model
# cannot be downloaded there: point SPECFORK_CACHE_DIR at a copy of a specfork cache folder
# that holds it (e.g. carry `.specfork-cache`, made with
# `SPECFORK_CACHE_DIR=.specfork-cache specfork models` after one generate on a networked
# machine). Writes its reports to $OUT (or ./gpu-check-out).
#
#     OUT=/tmp/out SPECFORK_CACHE_DIR=.specfork-cache bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export SPECFORK_CACHE_DIR="${SPECFORK_CACHE_DIR:-$PWD/.specfork-cache}"
py="${PYTHON:-python3}"

"$py" - <<'PY' | tee "$out/gpu.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
PY

# 1. exactness on the GPU (fp32 exact, bf16 differences at near-ties only)
timeout 300 "$py" -m pytest -q tests/test_cuda.py --junitxml="$out/cuda-tests.xml" \
    2>&1 | tail -20 | tee "$out/cuda-tests.txt"

# 2. a small interleaved bench on the GPU
timeout 240 "$py" -m specfork.cli bench --device cuda --dtype bfloat16 \
    --prompts benchmarks/prompts/specbench-dev.jsonl --per-category 1 --limit 6 -n 64 \
    --repeats 1 --no-plots --out "$out/bench" \
    --strategies 'ar,speculative:ngram?k=4,dspark:ngram,spork:recycle+ngram' \
    2>&1 | tail -30 | tee "$out/bench.txt"
