"""fulcrum.bench.kernel_ab: another revision's kernel sources, built beside the working tree's,
timed in alternating turns (benchmarks/attention_ab.py, benchmarks/linear_ab.py)."""

import ctypes
import subprocess

import pytest
import torch

from fulcrum import kernels
from fulcrum.bench.kernel_ab import REPO, alternate, build, builds, short_revision, sources_at


def test_alternate_reverses_the_order_every_other_turn_and_drops_the_warm_up():
    calls = []
    times = alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b"),
                       "c": lambda: calls.append("c")}, turns=3)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(seconds >= 0 for t in times.values() for seconds in t)


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git checkout")
def test_sources_at_takes_the_source_and_every_header_of_that_revision(tmp_path):
    sources_at("HEAD", "sampling.cpp", tmp_path)
    names = sorted(path.name for path in tmp_path.iterdir())
    listed = subprocess.run(["git", "ls-tree", "--name-only", "HEAD", "fulcrum/kernels/"],
                            cwd=REPO, check=True, capture_output=True, text=True).stdout.split()
    headers = [name.rsplit("/", 1)[1] for name in listed if name.endswith(".h")]
    assert headers and names == sorted(["sampling.cpp", *headers])
    committed = subprocess.run(["git", "show", "HEAD:fulcrum/kernels/sampling.cpp"], cwd=REPO,
                               check=True, capture_output=True, text=True).stdout
    assert (tmp_path / "sampling.cpp").read_text() == committed
    assert short_revision("HEAD") == subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True, capture_output=True,
        text=True).stdout.strip()


@pytest.mark.skipif(kernels.compiler() is None, reason="no C++ compiler")
def test_build_compiles_and_loads_a_kernel_that_runs(tmp_path):
    library = build(kernels.KERNEL_DIR, "sampling.cpp", tmp_path / "sampling.so")
    function = library.fulcrum_argmax_f32
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                         ctypes.c_void_p, ctypes.c_int]
    x = torch.tensor([[0.5, 3.0, -1.0, 2.0], [7.0, 1.0, 7.5, 0.0]])
    out = torch.empty(2, dtype=torch.int64)
    assert function(x.data_ptr(), 4, 2, 4, out.data_ptr(), 1) == 0
    assert out.tolist() == [1, 2]


@pytest.mark.skipif(kernels.compiler() is None or not (REPO / ".git").exists(),
                    reason="no C++ compiler, or not a git checkout")
def test_builds_gives_the_revision_and_the_working_tree_side_by_side(tmp_path):
    libraries = builds("HEAD", "sampling.cpp", tmp_path)
    assert sorted(libraries) == ["base", "new"]
    assert (tmp_path / "base" / "sampling.cpp").is_file()
    assert (tmp_path / "base.so").is_file() and (tmp_path / "new.so").is_file()
    assert libraries["base"]._name != libraries["new"]._name
