#!/usr/bin/env bash
# CUDA check for a machine with an NVIDIA GPU and no network (at most ~14 minutes; ~6 on an H200).
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

# 1. exactness on the GPU (fp32 exact, bf16 differences at near-ties only), batching, the
#    prefix cache and the server on a GPU model
timeout 360 "$py" -m pytest -q -rA tests/test_cuda.py --junitxml="$out/cuda-tests.xml" \
    > "$out/cuda-tests.txt" 2>&1
tail -25 "$out/cuda-tests.txt"

# 2. the command line on the GPU
timeout 120 "$py" -m specfork.cli generate --device cuda --strategy spork --drafter recycle+ngram \
    -n 48 --ignore-eos "Explain how a refrigerator works." 2>&1 | tail -8 | tee "$out/generate.txt"

# 3. a small interleaved bench on the GPU
timeout 240 "$py" -m specfork.cli bench --device cuda --dtype bfloat16 \
    --prompts benchmarks/prompts/specbench-dev.jsonl --per-category 1 --limit 6 -n 64 \
    --repeats 1 --no-plots --out "$out/bench" \
    --strategies 'ar,speculative:ngram?k=4,dspark:ngram,spork:recycle+ngram,speculative:head' \
    2>&1 | tail -30 | tee "$out/bench.txt"

# 4. where a step's time goes on the device (host time per operation; forwards by rows)
timeout 120 "$py" benchmarks/gpu_profile.py --device cuda --dtype bfloat16 > "$out/profile.txt" 2>&1
grep -E '^(ar|ngram):|^forward of' "$out/profile.txt"
