"""How fast a batch-1 decode step can read its weights on this machine, and how close the linear
kernels come to that.

The engine's own packed bf16 weights (smollm2-135m shape, dummy values, on huge pages as the
engine holds them), in the order a decode step uses them (QKV, O, gate/up and down of each
layer, then the LM head), are read four ways in turns (the order reversed every other turn),
in rounds a while apart (this machine's bandwidth drifts by up to 2x within minutes):
- `probe`: `fulcrum bench latency`'s bandwidth probe, one sum over a 512 MiB array: the rate
  the batch-1 figures are judged against;
- `one stream`: every matrix read with no arithmetic, each split between the threads, in one
  parallel region (a thread goes on to its share of the next matrix without waiting);
- `per matrix`: the same reads, one parallel region a matrix, as the kernels are called;
- `kernels`: `fulcrum_linear_bf16` at one row over the same matrices, in one native loop.
Each is a round's median rate over its turns (bytes read / time). The gap between `probe` and
`per matrix` is what a kernel call per projection costs any code on this machine; between
`per matrix` and `kernels`, what the kernels themselves lose. Rounds at different bandwidths
tell the two apart from the machine's drift.

    python benchmarks/weight_stream.py                    # results/weight_stream.{json,md}
    python benchmarks/weight_stream.py --name weight_stream-avx2   # another machine
"""

from __future__ import annotations

import ctypes
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

from fulcrum import kernels
from fulcrum.bench.kernel_ab import alternate, build
from fulcrum.bench.latency import BandwidthProbe
from fulcrum.bench.report import machine_facts, results_name, write_results
from fulcrum.bench.shapes import shape_dir
from fulcrum.llm import LLM

RESULTS = Path(__file__).resolve().parent / "results"
HERE = Path(__file__).resolve().parent
SHAPE = "smollm2-135m"
ROUNDS = 6
TURNS = 10  # a round's
PAUSE_S = 20.0  # between rounds
WAYS = ("probe", "one stream", "per matrix", "kernels")


def step_linears(model) -> List:
    """The packed linear layers a decode step runs, in its order."""
    layers = [m for layer in model.model.layers for m in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
        layer.mlp.down_proj)]
    return [*layers, model.lm_head]


def typed(helper: ctypes.CDLL) -> ctypes.CDLL:
    """weight_stream.cpp's library, its two functions given their argument types."""
    pointer, i32 = ctypes.c_void_p, ctypes.c_int
    helper.weight_stream_read.restype = ctypes.c_int64
    helper.weight_stream_read.argtypes = [pointer, pointer, i32, i32, i32]
    helper.weight_stream_linear.restype = i32
    helper.weight_stream_linear.argtypes = [pointer] * 4 + [i32, pointer, pointer, i32]
    return helper


def linear_kernel() -> ctypes.c_void_p:
    """The address of fulcrum_linear_bf16, for weight_stream_linear."""
    return ctypes.cast(kernels._linear_library().fulcrum_linear_bf16, ctypes.c_void_p)


def ways(helper: ctypes.CDLL, linears: List, threads: int) -> Dict[str, Callable[[], object]]:
    """Each way of reading the weights, as a call (`helper`: `typed`'s)."""
    count = len(linears)
    starts = (ctypes.c_void_p * count)(*[m.packed.data_ptr() for m in linears])
    sizes = (ctypes.c_int64 * count)(*[m.packed.numel() * m.packed.element_size()
                                       for m in linears])
    ins = (ctypes.c_int * count)(*[m.in_features for m in linears])
    outs = (ctypes.c_int * count)(*[m.out_features for m in linears])
    x = torch.randn(max(ins)).bfloat16()
    y = torch.empty(max(outs), dtype=torch.bfloat16)
    linear = linear_kernel()
    read, step = helper.weight_stream_read, helper.weight_stream_linear
    probe = BandwidthProbe()

    def kernels_step() -> None:
        if step(linear, starts, ins, outs, count, x.data_ptr(), y.data_ptr(), threads):
            raise RuntimeError("the linear kernel refused a matrix")

    return {"probe": probe,
            "one stream": lambda: read(starts, sizes, count, threads, 0),
            "per matrix": lambda: read(starts, sizes, count, threads, 1),
            "kernels": kernels_step}


def main() -> None:
    stem, command, _ = results_name("weight_stream.py", __doc__, "weight_stream")
    llm = LLM(shape_dir(SHAPE), load_format="dummy", dtype="bfloat16")
    linears = step_linears(llm.llm_engine.runner.model)
    if any(m.packed is None or m.packed.dtype != torch.bfloat16 for m in linears):
        raise SystemExit("this machine has no packed bf16 linear kernel to measure")
    weight_bytes = sum(m.packed.numel() * m.packed.element_size() for m in linears)
    threads = torch.get_num_threads()
    read_bytes = {name: 512 << 20 if name == "probe" else weight_bytes for name in WAYS}
    rounds: List[Dict[str, float]] = []  # each round's median GB/s of each way
    with tempfile.TemporaryDirectory() as tmp:
        calls = ways(typed(build(HERE, "weight_stream.cpp", Path(tmp) / "weight_stream.so")),
                     linears, threads)
        for number in range(ROUNDS):
            if number:
                time.sleep(PAUSE_S)
            times = alternate(calls, TURNS)
            rounds.append({name: statistics.median(read_bytes[name] / t for t in times[name])
                           / 1e9 for name in WAYS})
            print(f"round {number}: " + ", ".join(f"{name} {rate:.1f} GB/s"
                                                  for name, rate in rounds[-1].items()),
                  flush=True)
    machine = machine_facts()
    lines = ["# A batch-1 decode step's weights: the fastest read against the kernels", "",
             f"{SHAPE} shape, bf16, the engine's packed weights on huge pages "
             f"({weight_bytes / 1e6:.1f} MB in {len(linears)} matrices, a step's order), "
             f"{threads} threads; {ROUNDS} rounds {PAUSE_S:.0f} s apart, each {TURNS} turns "
             f"(the order reversed every other turn), its medians; rounds by the probe's rate; "
             f"{machine['cpu']}, {machine['cores']} cores, fulcrum's kernels: "
             f"{machine['kernels']}; {machine['date']}. Regenerate: `{command}`.", "",
             "| probe (GB/s) | one stream | per matrix | kernels | kernels / per matrix |",
             "|---:|---:|---:|---:|---:|"]
    for r in sorted(rounds, key=lambda r: r["probe"]):
        lines.append(f"| {r['probe']:.1f} | {r['one stream'] / r['probe']:.0%} "
                     f"| {r['per matrix'] / r['probe']:.0%} | {r['kernels'] / r['probe']:.0%} "
                     f"| {r['kernels'] / r['per matrix']:.0%} |")
    lines += ["", "Each read's rate as a share of the probe's in the same round, and the "
              "kernels' as a share of the read one parallel region a matrix."]
    write_results(RESULTS, stem, {"shape": SHAPE, "weight_bytes": weight_bytes,
                                  "matrices": len(linears), "threads": threads,
                                  "rounds": ROUNDS, "turns": TURNS, "gb_per_s": rounds,
                                  "machine": machine}, lines)


if __name__ == "__main__":
    main()
