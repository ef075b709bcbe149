"""Measuring instruments: an OpenAI-compatible load generator (`fulcrum bench serve`), offline
throughput (`fulcrum bench throughput`, optionally against HF transformers) and a scheduler
settings sweep (`fulcrum bench sweep`). Metrics follow vLLM's serving benchmark definitions so
numbers can be compared with published ones.
"""
