#!/usr/bin/env bash
# Reproduce the draft head shipped for smollm2-135m-instruct
# (src/specfork/heads/packaged_heads/smollm2-135m-instruct/) from nothing (docs/benchmarks.md,
# "The shipped head" and "The second shipped head"). On two cores of an AMD EPYC:
#   1. the target writes 2,400 task conversations (45 minutes, 2.2 GB) and a head is trained
#      on them from scratch (2,600 steps, 60 minutes): the first shipped head, in OUT_FOLDER;
#   2. 384 more task conversations and 2,256 self-written ones (Magpie-style: the
#      target writes the user turns too; ~0.8 a second), then the first head fine-tuned on
#      both sets (~1.3 s a step, ~55 minutes): the head shipped now, in OUT_FOLDER/second
#      (it was trained in two sittings: stopped at step 1,800, then resumed from that
#      checkpoint with this same command, which restores the optimiser and random states:
#      an uninterrupted run follows the same schedule).
#
#   benchmarks/packaged_head.sh OUT_FOLDER
#
# Every stage resumes: run it again after an interruption. Each head folder holds head.json,
# head.safetensors (bfloat16) and training.json; copy the two head files into the packaged
# folder to ship it.
set -euo pipefail
out=${1:?usage: benchmarks/packaged_head.sh OUT_FOLDER}
specfork=${SPECFORK:-specfork}

"$specfork" train-head -m smollm2-135m-instruct --out "$out" --data "$out/tasks-data" \
    --tasks --context-tokens 128 --samples 2400 --answer-tokens 256 --seed 0 \
    --steps 2600 --unroll 4 --draft-vocab 8192 --weight-decay 0.01 --holdout 0.05 \
    --checkpoint-every 200 --save-dtype bfloat16

"$specfork" train-head -m smollm2-135m-instruct --out "$out" --data "$out/tasks-data" \
    --tasks --context-tokens 128 --samples 2784 --answer-tokens 256 --seed 0 --data-only
"$specfork" train-head -m smollm2-135m-instruct --out "$out/second" --data "$out/self-data" \
    --samples 2256 --answer-tokens 256 --seed 0 --extra-data "$out/tasks-data" \
    --init "$out" --lr 5e-4 --steps 2400 --unroll 4 --weight-decay 0.01 \
    --holdout 0.05 --checkpoint-every 200 --save-dtype bfloat16
