#!/usr/bin/env bash
# Offline throughput, fulcrum vs HF transformers, on the SmolLM2-135M shape (dummy weights).
# Extra flags pass through, e.g. --dtype bfloat16 --hf-batch-size 32 --device cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
fulcrum bench throughput --compare-hf --shape smollm2-135m --num-prompts 64 --input-len 256 \
    --output-len 128 --hf-batch-size 16 --results-dir benchmarks/results "$@"
