"""Decode attention against where its KV blocks lie: what block placement could still buy.

One decode step's attention (the working tree's bf16 varlen kernel, 30 layers of the
smollm2-135m shape, each its own cache on huge pages) at one batch and context, run in turns
over the same caches with the sequences' block tables laid out several ways:

- runs: each sequence's blocks consecutive (a fresh engine's prompts, a lone request);
- prompt runs, decode interleaved: the prompt's blocks consecutive, the blocks its decode
  added (from `--prompt-len` on) one per sequence per step, interleaved across the batch,
  as the throughput workload's engine hands them out;
- server: as fulcrum's BlockManager (prefix caching on) hands them out after a long run of
  requests (`SERVER_REQUESTS` requests of random prompts of 64-512 tokens and 32-256 output
  tokens, `--batch` at a time, in a cache of `--blocks`): the first blocks of sequences long
  enough, taken at several moments after that;
- random: anywhere;
- in L2: every sequence reads the first one's blocks, one sequence's worth of cache a layer,
  which stays in the core's L2: the kernel's arithmetic with the memory taken away.

Each turn also sums as many blocks of each cache as a step reads, in one contiguous pass
(`read`): the memory's rate for that many bytes. Each layout's median time over turns, its
median time over the read's, and the share of its consecutive blocks that lie side by side.

    python benchmarks/attention_layout.py                      # results/attention_layout.*
    python benchmarks/attention_layout.py --name attention_layout-avx2   # another machine
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Callable, Dict

import torch

from attention_ab import BLOCK, HEAD_DIM, HEADS, KV_HEADS, RESULTS, Kernel, typed
from fulcrum import kernels
from fulcrum.bench.block_tables import long_run_tables
from fulcrum.bench.kernel_ab import alternate
from fulcrum.bench.report import machine_facts, results_name, write_results
from fulcrum.core.block_manager import BlockManager

LAYERS = 30
SERVER_REQUESTS = 3000


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=320,
                        help="tokens each sequence attends to")
    parser.add_argument("--prompt-len", type=int, default=256,
                        help="of the context, the tokens its prompt brought")
    parser.add_argument("--blocks", type=int, default=4000,
                        help="blocks of the cache (the server's, and every layout's)")
    parser.add_argument("--turns", type=int, default=15)


def layouts(batch: int, context: int, prompt_len: int, num_blocks: int,
            generator: torch.Generator) -> Dict[str, torch.Tensor]:
    """Block tables [batch, blocks a sequence] into a cache of `num_blocks` blocks (block 0,
    the engine's null block, in none)."""
    per = -(-context // BLOCK)
    prompt = min(-(-prompt_len // BLOCK), per)
    total = batch * per
    if total >= num_blocks:
        raise ValueError(f"{batch} x {per} blocks do not fit a cache of {num_blocks}")
    runs = 1 + torch.arange(total).view(batch, per)
    mixed = torch.empty(batch, per, dtype=torch.int64)
    mixed[:, :prompt] = 1 + torch.arange(batch * prompt).view(batch, prompt)
    mixed[:, prompt:] = 1 + batch * prompt + torch.arange(batch * (per - prompt)).view(
        per - prompt, batch).t()
    seed = int(torch.randint(2 ** 31, (1,), generator=generator))
    return {"runs": runs,
            "prompt runs, decode interleaved": mixed,
            "server": torch.tensor(long_run_tables(
                BlockManager(num_blocks, BLOCK, enable_prefix_caching=True), batch, per,
                SERVER_REQUESTS, random.Random(seed))),
            "random": 1 + torch.randperm(num_blocks - 1, generator=generator)[:total].view(
                batch, per),
            "in L2": runs[:1].expand(batch, per).contiguous()}


def adjacent_share(table: torch.Tensor) -> float:
    """The share of a table's consecutive block pairs that lie side by side (b, b + 1)."""
    return float((table[:, 1:] == table[:, :-1] + 1).double().mean())


def measure(kernel: Kernel, batch: int, context: int, prompt_len: int, num_blocks: int,
            turns: int) -> Dict[str, Dict[str, float]]:
    """{layout or "read": {"ms": median, "over_read": median of its time / the read's, and
    for a layout "adjacent": adjacent_share}}."""
    generator = torch.Generator().manual_seed(0)
    tables = layouts(batch, context, prompt_len, num_blocks, generator)
    caches = kernels.huge_page_tensors(
        [((num_blocks, KV_HEADS, BLOCK * HEAD_DIM), torch.bfloat16)] * (2 * LAYERS))
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

    def read() -> None:  # as many blocks as a step reads, side by side
        for cache in caches:
            cache[1:1 + tables["runs"].numel()].view(torch.float32).sum()

    calls: Dict[str, Callable[[], None]] = {name: step(t) for name, t in tables.items()}
    calls["read"] = read
    times = alternate(calls, turns)
    results = {name: {"ms": 1e3 * statistics.median(t),
                      "over_read": statistics.median(a / r for a, r in zip(t, times["read"]))}
               for name, t in times.items()}
    for name, table in tables.items():
        results[name]["adjacent"] = adjacent_share(table)
    return results


def main() -> None:
    stem, command, args = results_name("attention_layout.py", __doc__, "attention_layout",
                                       options)
    if not kernels.supports_varlen(torch.bfloat16, torch.bfloat16, HEADS // KV_HEADS,
                                   HEAD_DIM, BLOCK):
        raise SystemExit("this machine has no bf16 varlen attention kernel")
    kernel = typed(kernels.paged_attention())
    results = measure(kernel, args.batch, args.context, args.prompt_len, args.blocks,
                      args.turns)
    machine = machine_facts()
    kv_mb = args.batch * args.context * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2 / 1e6
    cache_mb = args.blocks * BLOCK * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2 / 1e6
    lines = ["# Decode attention against where its KV blocks lie", "",
             f"One decode step's bf16 paged attention (`paged_varlen_attention_bf16`, the "
             f"working tree's), batch {args.batch} at context {args.context} (the first "
             f"{args.prompt_len} tokens a prompt's), {LAYERS} layers of the smollm2-135m shape "
             f"({HEADS} query heads, {KV_HEADS} KV heads of {HEAD_DIM}, {BLOCK}-token blocks), "
             f"{kv_mb:.0f} MB of KV read from a cache of {args.blocks} blocks "
             f"({cache_mb:.0f} MB) on huge pages; the server's tables after "
             f"{SERVER_REQUESTS} requests through fulcrum's BlockManager; the layouts and a "
             f"contiguous read of as many blocks run in turns ({args.turns} after a warm-up); "
             f"medians; "
             f"{machine['cpu']}, {machine['cores']} cores, fulcrum's kernels: "
             f"{machine['kernels']}; {machine['date']}. Regenerate: `{command}`.", "",
             "| blocks | next block adjacent | ms | time / the read's |",
             "|---|---:|---:|---:|"]
    for name, r in results.items():
        adjacent = f"{r['adjacent']:.0%}" if "adjacent" in r else "-"
        lines.append(f"| {name} | {adjacent} | {r['ms']:.2f} | {r['over_read']:.2f} |")
    write_results(RESULTS, stem, {"batch": args.batch, "context": args.context,
                                  "prompt_len": args.prompt_len, "blocks": args.blocks,
                                  "server_requests": SERVER_REQUESTS, "turns": args.turns,
                                  "layers": LAYERS, "results": results, "machine": machine},
                  lines)


if __name__ == "__main__":
    main()
