"""The linear-layer kernel of the working tree against another revision's, side by side.

Both builds of kernels/linear_bf16.cpp (each with its revision's headers) are compiled with
the engine's flags and loaded into this one process (`fulcrum.bench.kernel_ab`). A case is
every projection of a step of the smollm2-135m shape (QKV, O, gate/up and down of 30 layers,
then the LM head) at one number of rows, with bf16 or int8 weights packed as the engine packs
them; each turn runs both builds on it (each first in half the turns). The figure is the
median over turns of new / base time, with its quartiles; the outputs of the two builds must
be equal, bit for bit.

    python benchmarks/linear_ab.py --base HEAD~1        # results/linear_ab.{json,md}
    python benchmarks/linear_ab.py --base HEAD~1 --name linear_ab-avx2   # another machine
"""

from __future__ import annotations

import ctypes
import statistics
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from fulcrum import kernels
from fulcrum.bench.kernel_ab import alternate, base_option, builds, short_revision
from fulcrum.bench.report import machine_facts, results_name, write_results

RESULTS = Path(__file__).resolve().parent / "results"
SOURCE = "linear_bf16.cpp"
TURNS = 40
LAYERS = 30
ROWS = (1, 8, 16, 24, 32, 48, 64, 128, 512)
# name -> (out features, in features, how many: one per layer, the head once)
PROJECTIONS = {"qkv": (960, 576, LAYERS), "o": (576, 576, LAYERS),
               "gate_up": (3072, 576, LAYERS), "down": (576, 1536, LAYERS),
               "head": (49152, 576, 1)}

Weight = Tuple[torch.Tensor, Optional[torch.Tensor]]  # packed panels, int8's scales


def typed(library: ctypes.CDLL) -> ctypes.CDLL:
    """The library, its two linear kernels given their argument types."""
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name, scaled in (("fulcrum_linear_bf16", False), ("fulcrum_linear_int8", True)):
        function = getattr(library, name)
        function.restype = i32
        function.argtypes = ([pointer, i64, pointer] + [pointer] * (2 + scaled)
                             + [i64] + [i32] * 5)
    return library


def weights(dtype: str, generator: torch.Generator) -> Dict[str, List[Weight]]:
    """Random weights of every projection, packed as the engine packs them."""
    packed: Dict[str, List[Weight]] = {}
    for name, (out_features, in_features, count) in PROJECTIONS.items():
        packed[name] = []
        for _ in range(count):
            weight = (torch.randn(out_features, in_features, generator=generator)
                      * in_features ** -0.5).bfloat16()
            if dtype == "int8":
                q, scale = kernels.quantize_int8(weight)
                packed[name].append((kernels.pack_linear_weight(q), scale))
            else:
                packed[name].append((kernels.pack_linear_weight(weight), None))
    return packed


def run_case(libraries: Dict[str, ctypes.CDLL], packed: Dict[str, List[Weight]],
             rows: int, generator: torch.Generator) -> Dict[str, object]:
    inputs = {name: torch.randn(rows, in_features, generator=generator).bfloat16()
              for name, (_, in_features, _) in PROJECTIONS.items()}
    outputs = {build_name: {name: torch.empty(rows, out_features, dtype=torch.bfloat16)
                            for name, (out_features, _, _) in PROJECTIONS.items()}
               for build_name in libraries}
    threads = torch.get_num_threads()

    def step(build_name: str) -> None:
        library = libraries[build_name]
        for name, (out_features, in_features, _) in PROJECTIONS.items():
            x, y = inputs[name], outputs[build_name][name]
            common = (y.data_ptr(), out_features, rows, out_features, in_features, 0, threads)
            for weight, scale in packed[name]:
                failed = (library.fulcrum_linear_bf16(x.data_ptr(), in_features,
                                                      weight.data_ptr(), None, *common)
                          if scale is None else
                          library.fulcrum_linear_int8(x.data_ptr(), in_features,
                                                      weight.data_ptr(), scale.data_ptr(), None,
                                                      *common))
                if failed:
                    raise RuntimeError(f"the {build_name} kernel refused {name}")

    times = alternate({name: (lambda name=name: step(name)) for name in sorted(libraries)}, TURNS)
    ratios = [n / b for n, b in zip(times["new"], times["base"])]
    quartiles = statistics.quantiles(ratios, n=4)
    return {"ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
            "ratio": statistics.median(ratios), "quartiles": [quartiles[0], quartiles[2]],
            "equal": all(torch.equal(outputs["base"][name], outputs["new"][name])
                         for name in PROJECTIONS)}


def main() -> None:
    stem, command, args = results_name("linear_ab.py", __doc__, "linear_ab", base_option)
    if not kernels.supports_linear(torch.zeros(2, 2, dtype=torch.bfloat16)):
        raise SystemExit("this machine has no packed linear kernel to compare")
    base = short_revision(args.base)
    generator = torch.Generator().manual_seed(0)
    results: Dict[str, Dict[int, Dict[str, object]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {name: typed(library)
                     for name, library in builds(base, SOURCE, Path(tmp)).items()}
        for dtype in ("bf16", "int8"):
            packed = weights(dtype, generator)
            results[dtype] = {}
            for rows in ROWS:
                result = run_case(libraries, packed, rows, generator)
                results[dtype][rows] = result
                print(f"{dtype}, {rows} rows: new / base {result['ratio']:.3f}", flush=True)
    machine = machine_facts()
    lines = ["# Linear layers: the working tree's kernel against an earlier one", "",
             f"`fulcrum_linear_bf16` and `fulcrum_linear_int8`, the working tree against "
             f"{base}, both built here and run in turns ({TURNS} turns after a warm-up, each "
             f"first in half of them) in one process; a case is every projection of a step of "
             f"the smollm2-135m shape ({LAYERS} layers of QKV, O, gate/up and down, then the "
             f"LM head) at one number of rows; medians and quartiles of new / base over turns; "
             f"{machine['cpu']}, {machine['cores']} cores, fulcrum's kernels: "
             f"{machine['kernels']}; {machine['date']}. Regenerate: `{command}`.", "",
             "| weights | rows | base (ms) | new (ms) | new / base | quartiles "
             "| outputs equal |",
             "|---|---:|---:|---:|---:|---|---|"]
    for dtype, cases in results.items():
        for rows, r in cases.items():
            lines.append(f"| {dtype} | {rows} | {r['ms']['base']:.2f} | {r['ms']['new']:.2f} "
                         f"| {r['ratio']:.3f} | {r['quartiles'][0]:.3f}-{r['quartiles'][1]:.3f} "
                         f"| {'yes' if r['equal'] else '**no**'} |")
    write_results(RESULTS, stem, {"base": base, "turns": TURNS, "cases": results,
                                  "machine": machine}, lines)


if __name__ == "__main__":
    main()
