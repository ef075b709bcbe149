"""Decode attention against where its KV blocks lie: what block placement could still buy.

One decode step's attention (the working tree's bf16 varlen kernel, 30 layers of the
smollm2-135m shape, each its own cache on huge pages) at one batch and context, run in turns
over the same caches with the sequences' block tables laid out several ways:

- runs: each sequence's blocks consecutive (a fresh engine's prompts, a lone request);
- prompt runs, decode interleaved: the prompt's blocks consecutive, the blocks its decode
  added (from `--prompt-len` on) one per sequence per step, interleaved across the batch,
  as the throughput workload's engine hands them out;
- random: anywhere (a long-running server, whose free queue takes blocks back in the order
  they are freed);
- in L2: every sequence reads the first one's blocks, one sequence's worth of cache a layer,
  which stays in the core's L2: the kernel's arithmetic with the memory taken away.

Each turn also sums the caches in one contiguous pass (`read`): the memory's rate for the
same bytes. The median over turns of each layout's time, and its time over the read's.

    python benchmarks/attention_layout.py                      # results/attention_layout.*
    python benchmarks/attention_layout.py --name attention_layout-avx2   # another machine
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable, Dict

import torch

from attention_ab import BLOCK, HEAD_DIM, HEADS, KV_HEADS, RESULTS, Kernel, typed
from fulcrum import kernels
from fulcrum.bench.kernel_ab import alternate
from fulcrum.bench.report import machine_facts, results_name, write_results

LAYERS = 30


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=320,
                        help="tokens each sequence attends to")
    parser.add_argument("--prompt-len", type=int, default=256,
                        help="of the context, the tokens its prompt brought")
    parser.add_argument("--turns", type=int, default=15)


def layouts(batch: int, context: int, prompt_len: int,
            generator: torch.Generator) -> Dict[str, torch.Tensor]:
    """Block tables [batch, blocks a sequence] over `batch` x blocks cache blocks."""
    per = -(-context // BLOCK)
    prompt = min(-(-prompt_len // BLOCK), per)
    total = batch * per
    runs = torch.arange(total).view(batch, per)
    mixed = torch.empty(batch, per, dtype=torch.int64)
    mixed[:, :prompt] = torch.arange(batch * prompt).view(batch, prompt)
    mixed[:, prompt:] = batch * prompt + torch.arange(batch * (per - prompt)).view(
        per - prompt, batch).t()
    return {"runs": runs,
            "prompt runs, decode interleaved": mixed,
            "random": torch.randperm(total, generator=generator).view(batch, per),
            "in L2": runs[:1].expand(batch, per).contiguous()}


def measure(kernel: Kernel, batch: int, context: int, prompt_len: int,
            turns: int) -> Dict[str, Dict[str, float]]:
    """{layout or "read": {"ms": median, "over_read": median of its time / the read's}}."""
    generator = torch.Generator().manual_seed(0)
    tables = layouts(batch, context, prompt_len, generator)
    blocks = tables["runs"].numel()
    caches = kernels.huge_page_tensors([((blocks, KV_HEADS, BLOCK * HEAD_DIM), torch.bfloat16)]
                                       * (2 * LAYERS))
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=generator) * 0.5)
    query_start = torch.arange(batch + 1, dtype=torch.int64)
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    row_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM  # queries read in place from fused QKV rows
    q = torch.randn(batch, row_width, generator=generator).bfloat16()
    out = torch.empty(batch, HEADS * HEAD_DIM, dtype=torch.bfloat16)
    threads = torch.get_num_threads()

    def step(table: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            for layer in range(LAYERS):
                if kernel(q.data_ptr(), row_width, caches[2 * layer].data_ptr(),
                          caches[2 * layer + 1].data_ptr(), table.data_ptr(),
                          query_start.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), batch,
                          HEADS, KV_HEADS, HEAD_DIM, BLOCK, table.shape[1], HEAD_DIM ** -0.5,
                          0, threads):
                    raise RuntimeError("the kernel refused the case")
        return run

    def read() -> None:
        for cache in caches:
            cache.view(torch.float32).sum()

    calls: Dict[str, Callable[[], None]] = {name: step(t) for name, t in tables.items()}
    calls["read"] = read
    times = alternate(calls, turns)
    return {name: {"ms": 1e3 * statistics.median(t),
                   "over_read": statistics.median(a / r for a, r in zip(t, times["read"]))}
            for name, t in times.items()}


def main() -> None:
    stem, command, args = results_name("attention_layout.py", __doc__, "attention_layout",
                                       options)
    if not kernels.supports_varlen(torch.bfloat16, torch.bfloat16, HEADS // KV_HEADS,
                                   HEAD_DIM, BLOCK):
        raise SystemExit("this machine has no bf16 varlen attention kernel")
    kernel = typed(kernels.paged_attention())
    results = measure(kernel, args.batch, args.context, args.prompt_len, args.turns)
    machine = machine_facts()
    kv_mb = args.batch * args.context * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2 / 1e6
    lines = ["# Decode attention against where its KV blocks lie", "",
             f"One decode step's bf16 paged attention (`paged_varlen_attention_bf16`, the "
             f"working tree's), batch {args.batch} at context {args.context} (the first "
             f"{args.prompt_len} tokens a prompt's), {LAYERS} layers of the smollm2-135m shape "
             f"({HEADS} query heads, {KV_HEADS} KV heads of {HEAD_DIM}, {BLOCK}-token blocks), "
             f"{kv_mb:.0f} MB of KV cache on huge pages; the layouts and a contiguous read of "
             f"the same caches run in turns ({args.turns} after a warm-up); medians; "
             f"{machine['cpu']}, {machine['cores']} cores, fulcrum's kernels: "
             f"{machine['kernels']}; {machine['date']}. Regenerate: `{command}`.", "",
             "| blocks | ms | time / the read's |", "|---|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['ms']:.2f} | {r['over_read']:.2f} |")
    write_results(RESULTS, stem, {"batch": args.batch, "context": args.context,
                                  "prompt_len": args.prompt_len, "turns": args.turns,
                                  "layers": LAYERS, "results": results, "machine": machine},
                  lines)


if __name__ == "__main__":
    main()
