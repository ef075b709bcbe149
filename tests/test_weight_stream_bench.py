"""benchmarks/weight_stream.py's native side: both reads of the weights touch every byte once
(their sums equal the data's, however the matrices split between threads), and its loop of
linear kernels computes what the kernel computes called alone. No timing assertions."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import load_benchmark
from fulcrum import kernels

bench = load_benchmark("weight_stream.py")


@pytest.fixture(scope="module")
def helper(tmp_path_factory):
    if kernels.compiler() is None:
        pytest.skip("no C++ compiler")
    return bench.typed(bench.build(bench.HERE, "weight_stream.cpp",
                                   tmp_path_factory.mktemp("ws") / "weight_stream.so"))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_both_reads_sum_every_byte_once(helper, threads):
    generator = torch.Generator().manual_seed(threads)
    # Sizes of 128-byte steps that split unevenly between the threads.
    matrices = [torch.randint(-2 ** 40, 2 ** 40, (16 * steps,), generator=generator)
                for steps in (1, 5, 7, 64)]
    starts = (ctypes.c_void_p * 4)(*[m.data_ptr() for m in matrices])
    sizes = (ctypes.c_int64 * 4)(*[m.numel() * 8 for m in matrices])
    expected = sum(int(m.sum()) for m in matrices)
    assert helper.weight_stream_read(starts, sizes, 4, threads, 1) == expected
    assert helper.weight_stream_read(starts, sizes, 4, threads, 0) == expected


def test_the_kernel_loop_computes_what_the_kernel_computes(helper):
    if not kernels.supports_linear(torch.zeros(2, 2, dtype=torch.bfloat16)):
        pytest.skip("no packed linear kernel on this machine")
    generator = torch.Generator().manual_seed(0)
    shapes = [(48, 64), (32, 96)]  # (out, in)
    packed = [kernels.pack_linear_weight(
        torch.randn(out, inp, generator=generator).bfloat16()) for out, inp in shapes]
    x = torch.randn(96, generator=generator).bfloat16()
    y = torch.full((48,), float("nan"), dtype=torch.bfloat16)
    for count in (1, 2):  # the row holds the last matrix's output
        status = helper.weight_stream_linear(
            bench.linear_kernel(),
            (ctypes.c_void_p * count)(*[p.data_ptr() for p in packed[:count]]),
            (ctypes.c_int * count)(*[inp for _, inp in shapes[:count]]),
            (ctypes.c_int * count)(*[out for out, _ in shapes[:count]]), count, x.data_ptr(),
            y.data_ptr(), 2)
        assert status == 0
        out, inp = shapes[count - 1]
        expected = kernels.linear_bf16(x[:inp].view(1, inp), packed[count - 1], None, out)
        assert torch.equal(y[:out], expected[0])
