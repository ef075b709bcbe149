#!/usr/bin/env bash
# The head-of-line scenario over scheduler settings: 2 long prompts (2048 tokens) at the start,
# 32 short ones (64 tokens) arriving at 4/s, 32 output tokens each. Extra flags pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
fulcrum bench sweep --shape smollm2-135m --dataset mixed --num-prompts 32 --input-len 64 \
    --output-len 32 --long-num-prompts 2 --long-input-len 2048 --request-rate 4 \
    --grid "max_num_batched_tokens=256,1024,2048" --grid "long_prefill_token_threshold=64,256" \
    --grid "enable_chunked_prefill=false" --grid "batching_mode=static" \
    --output-dir benchmarks/results/sweep "$@"
