"""Scheduling and KV-block bookkeeping: requests, the per-step budget, the policies, the
step-time model, block tables and the prefix cache. Plain Python: no tensors here."""
