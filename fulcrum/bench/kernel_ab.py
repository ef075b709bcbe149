"""One kernel source of two revisions side by side in one process (benchmarks/attention_ab.py,
benchmarks/linear_ab.py).

Each revision's source, with that revision's headers, is compiled with the engine's flags and
loaded beside the other; the cases then run both in alternating turns, so the machine's
drifts (up to 2x within minutes on a shared VM) fall on both alike.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List

from fulcrum import kernels

REPO = Path(__file__).resolve().parents[2]


def short_revision(revision: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", revision], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout.strip()


def sources_at(revision: str, source: str, into: Path) -> Path:
    """fulcrum/kernels/`source` and every kernel header as they were at `revision`, in `into`."""
    names = subprocess.run(["git", "ls-tree", "--name-only", revision, "fulcrum/kernels/"],
                           cwd=REPO, check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".h", f"/{source}")):
            text = subprocess.run(["git", "show", f"{revision}:{name}"], cwd=REPO, check=True,
                                  capture_output=True, text=True).stdout
            (into / Path(name).name).write_text(text)
    return into


def build(sources: Path, source: str, out: Path) -> ctypes.CDLL:
    """`source` in `sources` (beside its headers), compiled as the engine compiles it and
    loaded (not through the engine's cache, whose key is this tree's headers)."""
    found = kernels.compiler()
    if found is None:
        raise SystemExit("no C++ compiler found ($CXX, else g++)")
    subprocess.run([found, *kernels.FLAGS, str(sources / source), "-o", str(out)], check=True)
    return ctypes.CDLL(str(out))


def base_option(parser: argparse.ArgumentParser) -> None:
    """The scripts' `--base`: the revision the working tree is compared against."""
    parser.add_argument("--base", required=True, help="the git revision to compare against")


def builds(revision: str, source: str, root: Path) -> Dict[str, ctypes.CDLL]:
    """{"base": `source` as of `revision`, "new": the working tree's}, built under `root`."""
    (root / "base").mkdir()
    return {"base": build(sources_at(revision, source, root / "base"), source,
                          root / "base.so"),
            "new": build(kernels.KERNEL_DIR, source, root / "new.so")}


def alternate(calls: Dict[str, Callable[[], object]], turns: int) -> Dict[str, List[float]]:
    """Each call's wall time in each of `turns` turns, after one warm-up turn; the calls run in
    order, and in reverse order every other turn, so each runs first in half of them."""
    times: Dict[str, List[float]] = {name: [] for name in calls}
    for turn in range(turns + 1):
        for name in (reversed(list(calls)) if turn % 2 else list(calls)):
            start = time.perf_counter()
            calls[name]()
            if turn:
                times[name].append(time.perf_counter() - start)
    return times
