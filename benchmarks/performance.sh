#!/usr/bin/env bash
# Regenerate docs/performance.md (+ .json): fulcrum's variants, HF transformers, vLLM's CPU
# build and llama.cpp's server (each peer if installed) on the throughput, decode and mixed
# workloads, medians of 3 runs. Needs the machine to itself for about 90 minutes on 2 cores
# (~30 without llama.cpp's server). Extra flags pass through, e.g. --engines fulcrum,vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
fulcrum bench report --out docs/performance.md --repeats 3 "$@"
