#!/usr/bin/env bash
# Reproduce the draft head shipped for smollm2-135m-instruct
# (src/specfork/heads/packaged_heads/smollm2-135m-instruct/) from nothing: the target writes its
# own training data from task templates, then a head is trained on it (docs/benchmarks.md,
# "The shipped head"). On two cores of an AMD EPYC: 45 minutes of data (2,400 conversations,
# 2.2 GB), then 60 minutes of training (2,600 steps).
#
#   benchmarks/packaged_head.sh OUT_FOLDER
#
# Both stages resume: run it again after an interruption. The head lands in OUT_FOLDER
# (head.json, head.safetensors in bfloat16, training.json); copy those two head files into
# the packaged folder to ship it.
set -euo pipefail
out=${1:?usage: benchmarks/packaged_head.sh OUT_FOLDER}
specfork=${SPECFORK:-specfork}

"$specfork" train-head -m smollm2-135m-instruct --out "$out" --data "$out/tasks-data" \
    --tasks --context-tokens 128 --samples 2400 --answer-tokens 256 --seed 0 \
    --steps 2600 --unroll 4 --draft-vocab 8192 --weight-decay 0.01 --holdout 0.05 \
    --checkpoint-every 200 --save-dtype bfloat16
