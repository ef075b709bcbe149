"""The bf16 paged-attention kernel of the working tree against another revision's, side by side.

Both builds of kernels/paged_attention.cpp (each with its revision's headers) are compiled with
the engine's flags and loaded into this one process; each case then runs them in turns, so
the machine's drifts (up to 2x within minutes here) fall on both, and each runs first in half
the turns. A case is a step's
attention through 30 layers (10 for the long prefill chunks) of the smollm2-135m shape (9
query heads, 3 KV heads of 64), each layer its own cache on huge pages as the engine
allocates it, the blocks of every sequence in random order as a busy cache hands them out:
prefill chunks at several contexts, and decodes at batch 1, 8 and 64. The figure is the
median over turns of new / base time; the outputs of the two builds are compared too.
Decodes, bound by memory, are also judged against the memory itself: each turn sums their
caches in one contiguous pass, and the table gives new's rate as a share of that read's.

    python benchmarks/attention_ab.py --base HEAD~1        # results/attention_ab.{json,md}
    python benchmarks/attention_ab.py --base HEAD~1 --name attention_ab-avx2   # another machine
"""

from __future__ import annotations

import ctypes
import statistics
import tempfile
from pathlib import Path
from typing import Callable, Dict, Sequence

import torch

from fulcrum import kernels
from fulcrum.bench.kernel_ab import alternate, base_option, builds, short_revision
from fulcrum.bench.report import machine_facts, results_name, write_results

RESULTS = Path(__file__).resolve().parent / "results"
SOURCE = "paged_attention.cpp"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
TURNS = 15
# name -> (context length of each sequence, its new tokens, layers)
CASES = {"prefill 512 rows at context 2048": ([2048], [512], 10),
         "prefill 512 rows at context 512": ([512], [512], 10),
         "prefill 64 rows at context 1024": ([1024], [64], 30),
         "decode, batch 64 at context 320": ([320] * 64, [1] * 64, 30),
         "decode, batch 8 at context 2048": ([2048] * 8, [1] * 8, 30),
         "decode, batch 1 at context 4096": ([4096], [1], 30)}

Kernel = Callable[..., int]


def typed(library: ctypes.CDLL) -> Kernel:
    """The library's attention kernel, with its argument types."""
    function = library.paged_varlen_attention_bf16
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    function.restype = i32
    function.argtypes = [pointer, i64] + [pointer] * 6 + [i32] * 6 + [ctypes.c_float, i32, i32]
    return function


def run_case(kernels_by_build: Dict[str, Kernel], lens: Sequence[int], new: Sequence[int],
             layers: int) -> Dict[str, object]:
    generator = torch.Generator().manual_seed(0)
    blocks = sum(-(-n // BLOCK) for n in lens)
    caches = kernels.huge_page_tensors([((blocks, KV_HEADS, BLOCK * HEAD_DIM), torch.bfloat16)]
                                       * (2 * layers))
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=generator) * 0.5)
    order = torch.randperm(blocks, generator=generator)
    width = max(-(-n // BLOCK) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    taken = 0
    for s, n in enumerate(lens):
        count = -(-n // BLOCK)
        tables[s, :count] = order[taken:taken + count]
        taken += count
    query_start = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int64)
    rows = int(query_start[-1])
    row_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM  # queries read in place from fused QKV rows
    q = torch.randn(rows, row_width, generator=generator).bfloat16()
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    outs = {name: torch.empty(rows, HEADS * HEAD_DIM, dtype=torch.bfloat16)
            for name in kernels_by_build}

    def step(name: str) -> None:
        for layer in range(layers):
            failed = kernels_by_build[name](
                q.data_ptr(), row_width, caches[2 * layer].data_ptr(),
                caches[2 * layer + 1].data_ptr(), tables.data_ptr(), query_start.data_ptr(),
                seq_lens.data_ptr(), outs[name].data_ptr(), len(lens), HEADS, KV_HEADS,
                HEAD_DIM, BLOCK, width, HEAD_DIM ** -0.5, 0, torch.get_num_threads())
            if failed:
                raise RuntimeError(f"the {name} kernel refused the case")

    def read() -> None:
        """The same caches summed, each in one contiguous pass (as latency.BandwidthProbe
        reads): the memory's rate for these bytes, where the kernel meets them in blocks."""
        for cache in caches:
            cache.view(torch.float32).sum()

    decodes = all(n == 1 for n in new)  # bound by memory: judged against a plain read too
    calls: Dict[str, Callable[[], None]] = {name: (lambda name=name: step(name))
                                            for name in sorted(kernels_by_build)}
    if decodes:
        calls["read"] = read
    times = alternate(calls, TURNS)
    result = {"layers": layers,
              "ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
              "ratio": statistics.median(n / b for n, b in zip(times["new"], times["base"])),
              "max_abs_diff": (outs["new"].float() - outs["base"].float()).abs().max().item()}
    if decodes:
        result["read_rate_share"] = statistics.median(
            r / n for r, n in zip(times["read"], times["new"]))
    return result


def main() -> None:
    stem, command, args = results_name("attention_ab.py", __doc__, "attention_ab", base_option)
    base = short_revision(args.base)
    with tempfile.TemporaryDirectory() as tmp:
        kernels_by_build = {name: typed(library)
                            for name, library in builds(base, SOURCE, Path(tmp)).items()}
        results = {}
        for name, (lens, new, layers) in CASES.items():
            results[name] = run_case(kernels_by_build, lens, new, layers)
            print(f"{name}: new / base {results[name]['ratio']:.3f}", flush=True)
    machine = machine_facts()
    data = {"base": base, "turns": TURNS, "cases": results, "machine": machine}
    lines = ["# Paged attention: the working tree's kernel against an earlier one", "",
             f"bf16 paged attention (`paged_varlen_attention_bf16`), the working tree against "
             f"{base}, both built here and run in turns ({TURNS} turns after a warm-up, each "
             f"first in half of them) in one process; smollm2-135m shape ({HEADS} query heads, {KV_HEADS} KV heads of "
             f"{HEAD_DIM}), a cache per layer on huge pages, blocks in random order; medians; "
             f"{machine['cpu']}, {machine['cores']} cores, fulcrum's kernels: "
             f"{machine['kernels']}; {machine['date']}. Regenerate: `{command}`.", "",
             "Decodes are bound by memory: each turn also sums their caches in one contiguous "
             "pass (`read`), and the last column is new's rate over that read's (median over "
             "turns).", "",
             "| case | layers | base (ms) | new (ms) | new / base | largest output difference "
             "| read (ms) | new's rate / read's |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        read = (f"{r['ms']['read']:.2f} | {r['read_rate_share']:.2f}" if "read" in r["ms"]
                else "- | -")
        lines.append(f"| {name} | {r['layers']} | {r['ms']['base']:.2f} | {r['ms']['new']:.2f} "
                     f"| {r['ratio']:.3f} | {r['max_abs_diff']:.2g} | {read} |")
    write_results(RESULTS, stem, data, lines)


if __name__ == "__main__":
    main()
