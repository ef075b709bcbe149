"""Weights and the KV cache on huge pages (kernels.huge_page_tensors): the tensors are laid
out as asked, apart and aligned, and where Linux offers transparent huge pages the packed
weights and the KV cache really sit on them."""

from pathlib import Path

import pytest
import torch

from fulcrum import LLM, kernels
from fulcrum.models.layers import Linear

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_offered() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            start, end = (int(part, 16) for part in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_tensors_are_laid_out_as_asked_apart_and_aligned():
    layout = [((3, 5), torch.bfloat16), ((7,), torch.int8), ((2, 2), torch.float32),
              ((40, 3), torch.int8)]
    tensors = kernels.huge_page_tensors(layout)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == [(tuple(s), d) for s, d in layout]
    assert all(t.data_ptr() % 64 == 0 for t in tensors)
    for i, tensor in enumerate(tensors):  # writing one leaves the others as they were
        tensor.fill_(i + 1)
    assert [t.float().unique().tolist() for t in tensors] == [[1.0], [2.0], [3.0], [4.0]]
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in tensors]
    assert all(end <= following.data_ptr() for end, following in zip(ends, tensors[1:]))


@pytest.mark.skipif(not huge_pages_offered(), reason="no transparent huge pages here")
def test_a_huge_page_tensor_is_backed_by_huge_pages():
    tensor = kernels.huge_page_tensor(8 << 20).fill_(1)
    assert tensor.data_ptr() % kernels.HUGE_PAGE == 0
    assert huge_kib_at(tensor.data_ptr()) >= 8 << 10


@pytest.mark.skipif(not huge_pages_offered() or not kernels.supports_linear(
    torch.zeros(2, 2, dtype=torch.bfloat16)), reason="no huge pages or no packed kernels here")
def test_packed_weights_and_the_kv_cache_sit_on_huge_pages(llama_dir):
    llm = LLM(str(llama_dir), dtype="bfloat16", kv_cache_memory_bytes=8 << 20)
    runner = llm.llm_engine.runner
    packed = [m.packed for m in runner.model.modules()
              if isinstance(m, Linear) and m.packed is not None]
    assert len(packed) == 4 * runner.model.spec.num_layers + 1  # and the LM head
    # one arena, in the order a step reads them
    assert [p.data_ptr() for p in packed] == sorted(p.data_ptr() for p in packed)
    assert huge_kib_at(packed[0].data_ptr()) > 0
    assert huge_kib_at(runner.kv_caches[0][0].data_ptr()) > 0
    assert huge_kib_at(runner.kv_caches[-1][1].data_ptr()) > 0
