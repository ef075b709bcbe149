#!/usr/bin/env bash
# Offline throughput, fulcrum vs HF transformers, on the SmolLM2-135M shape (dummy weights).
# bfloat16 on both sides (fulcrum's kernels run it at twice float32's speed) and a 2048-token
# step budget, as for offline use. Extra flags pass through and win, e.g. --hf-batch-size 32.
set -euo pipefail
cd "$(dirname "$0")/.."
fulcrum bench throughput --compare-hf --shape smollm2-135m --num-prompts 64 --input-len 256 \
    --output-len 128 --hf-batch-size 16 --dtype bfloat16 --max-num-batched-tokens 2048 \
    --results-dir benchmarks/results "$@"
