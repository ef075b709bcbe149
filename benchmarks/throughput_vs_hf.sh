#!/usr/bin/env bash
# Offline throughput, fulcrum vs HF transformers, on the SmolLM2-135M shape (dummy weights).
# float32 (faster than bfloat16 on CPUs without AMX) and a 2048-token step budget, as for
# offline use. Extra flags pass through and win, e.g. --dtype bfloat16 --hf-batch-size 32.
set -euo pipefail
cd "$(dirname "$0")/.."
fulcrum bench throughput --compare-hf --shape smollm2-135m --num-prompts 64 --input-len 256 \
    --output-len 128 --hf-batch-size 16 --dtype float32 --max-num-batched-tokens 2048 \
    --results-dir benchmarks/results "$@"
