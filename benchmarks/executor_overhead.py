"""Did the executor seam cost the single-process engine anything per step?

The per-step overhead of docs/performance.md (fulcrum offline, the throughput workload's 64
requests decoding together, smollm2-135m shape, bfloat16: a step's wall time and the share
outside the forward pass), measured on this tree and on a commit from before the seam
(checked out into a temporary git worktree), runs alternating, each in a fresh process.

    python benchmarks/executor_overhead.py [--base 6f0237a] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BASE = "6f0237a"  # the last commit before the executor seam

MEASURE = """
import json, sys
import numpy as np
import fulcrum
from fulcrum.bench.datasets import random_requests
from fulcrum.bench.shapes import shape_dir
from fulcrum.bench.throughput import measure_step_overhead
requests = random_requests(64, 256, 128, 0.0, np.random.default_rng(0))
result = measure_step_overhead(shape_dir("smollm2-135m"),
                               {"dtype": "bfloat16", "load_format": "dummy"}, requests)
result["module"] = fulcrum.__file__
print("RESULT " + json.dumps(result))
"""


def measure(tree: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE], cwd=tree, capture_output=True,
                          text=True, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin",
                                          "HOME": str(Path.home())}, check=True)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    result = json.loads(line[7:])
    if not result.pop("module").startswith(str(tree)):
        raise RuntimeError(f"{tree} did not import its own fulcrum")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=BASE)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        base_tree = Path(scratch) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.base],
                       cwd=REPO, check=True, capture_output=True)
        try:
            runs = {"before (" + args.base + ")": [], "this tree": []}
            for _ in range(args.repeats):
                for name, tree in zip(runs, (base_tree, REPO)):
                    runs[name].append(measure(tree))
                    print(name, runs[name][-1], flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO,
                           check=True)
    summary = {name: {"step_ms": statistics.median(r["step_ms"] for r in rs),
                      "forward_ms": statistics.median(r["forward_ms"] for r in rs),
                      "outside_forward_ms": statistics.median(r["step_ms"] - r["forward_ms"]
                                                              for r in rs),
                      "overhead_fraction": statistics.median(r["overhead_fraction"] for r in rs)}
               for name, rs in runs.items()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "executor_overhead.json").write_text(json.dumps(
        {"base": args.base, "repeats": args.repeats, "runs": runs, "median": summary},
        indent=1) + "\n")
    lines = ["# Per-step overhead before and after the executor seam", "",
             "fulcrum offline, 64 requests decoding together (throughput workload, smollm2-135m "
             f"shape, bfloat16), medians of {args.repeats} alternating runs, each in a fresh "
             "process; `python benchmarks/executor_overhead.py` regenerates it.", "",
             "| tree | step (ms) | forward (ms) | outside the forward (ms) | overhead share |",
             "|---|---|---|---|---|"]
    lines += [f"| {name} | {s['step_ms']:.1f} | {s['forward_ms']:.1f} | "
              f"{s['outside_forward_ms']:.2f} | {100 * s['overhead_fraction']:.1f}% |"
              for name, s in summary.items()]
    (RESULTS / "executor_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
