#!/usr/bin/env bash
# Regenerate docs/performance.md (+ .json): fulcrum's variants, HF transformers and vLLM's CPU
# build (if installed) on the throughput, decode and mixed workloads, medians of 3 runs. Needs
# the machine to itself for ~30 min. Extra flags pass through, e.g. --engines fulcrum,vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
fulcrum bench report --out docs/performance.md --repeats 3 "$@"
