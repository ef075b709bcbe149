#!/usr/bin/env bash
# Goodput against offered load: fulcrum's slo policy, fixed token budgets, vLLM's CPU build
# (default and tuned, if installed) on chat-like bursty traffic. Needs the machine to itself
# for ~20 min. Writes benchmarks/results/goodput/goodput.{md,json,png}; extra flags pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
fulcrum bench goodput --rates 2,4,6,8 --num-prompts 40 "$@"
