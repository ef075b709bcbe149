"""Native CPU kernels against float64 references: the bf16 linear over packed weights and the
paged decode attention (every specialised shape), including ragged blocks, sliding windows
and NaN in unwritten cache slots."""

import contextlib
import math

import pytest
import torch

from fulcrum import kernels

needs_linear = pytest.mark.skipif(
    not kernels.supports_linear(torch.zeros(2, 2, dtype=torch.bfloat16)),
    reason="no AVX512-BF16 or AVX2 linear kernel on this machine")


def test_instruction_set_names_the_kernels_that_run(kernel_path):
    """What benchmarks record: the build the linear kernel has on this CPU, or "torch" where
    there is none (disabled here by the torch half of the fixture)."""
    isa = kernels.instruction_set()
    has_kernel = kernels.supports_linear(torch.zeros(2, 2, dtype=torch.bfloat16))
    if kernel_path == "torch":
        assert isa == "torch" and not has_kernel
    else:
        assert isa in ("avx512-bf16", "avx2", "torch") and has_kernel == (isa != "torch")
        flags = set(next(line for line in open("/proc/cpuinfo")
                         if line.startswith("flags")).split(":", 1)[1].split())
        if isa == "avx2":
            assert {"avx2", "fma"} <= flags and not {"avx512_bf16", "avx512_vnni"} <= flags
        if isa == "avx512-bf16":
            assert {"avx512_bf16", "avx512_vnni"} <= flags


@needs_linear
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (100, 64), (49, 30)])
# Row counts that make every tile size of both instruction sets' row tiles (6 on AVX2, 8 on
# AVX-512): 8 = 6 + 2, 11 = 6 + 5 (8 + 3), 13 = 6 + 6 + 1 (8 + 5), 70 = 11 x 6 + 4 (8 x 8 + 6).
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 13, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_bf16_matches_float64(out_features, in_features, rows, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    reference = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    packed = kernels.pack_linear_weight(weight)
    got32 = kernels.linear_bf16(x, packed, bias, out_features, torch.float32)
    assert got32.dtype == torch.float32 and got32.shape == (rows, out_features)
    torch.testing.assert_close(got32.double(), reference, atol=1e-3, rtol=1e-4)
    got16 = kernels.linear_bf16(x, packed, bias, out_features)
    assert got16.dtype == torch.bfloat16
    # bf16 output: the float32 result rounded once.
    assert torch.equal(got16, got32.bfloat16())


@needs_linear
def test_linear_bf16_takes_strided_rows_and_leading_dims():
    weight = torch.randn(64, 32).bfloat16()
    packed = kernels.pack_linear_weight(weight)
    wide = torch.randn(5, 64).bfloat16()
    x = wide[:, :32]  # row stride 64
    got = kernels.linear_bf16(x, packed, None, 64, torch.float32)
    torch.testing.assert_close(got, x.float() @ weight.float().T, atol=1e-3, rtol=1e-4)
    batched = torch.randn(2, 3, 32).bfloat16()
    assert kernels.linear_bf16(batched, packed, None, 64).shape == (2, 3, 64)


_STEAL_CHECK = """
import ctypes
import torch
from fulcrum import kernels
print(ctypes.CDLL("libgomp.so.1").omp_get_thread_limit())  # torch's, already loaded
generator = torch.Generator().manual_seed(0)
x = torch.randn(37, 96, generator=generator).bfloat16()
weight = torch.randn(200, 96, generator=generator).bfloat16()
q, scale = kernels.quantize_int8(weight)
library = kernels._linear_library()
for packed, scale in ((kernels.pack_linear_weight(weight), None),
                      (kernels.pack_linear_weight(q), scale)):
    alone = kernels.linear_bf16(x, packed, None, 200, torch.float32, scale)
    asked = torch.full_like(alone, float("nan"))
    common = (asked.data_ptr(), 200, 37, 200, 96, 1, 4)
    if scale is None:
        status = library.fulcrum_linear_bf16(x.data_ptr(), 96, packed.data_ptr(), None, *common)
    else:
        status = library.fulcrum_linear_int8(x.data_ptr(), 96, packed.data_ptr(),
                                             scale.data_ptr(), None, *common)
    print(status, torch.equal(asked, alone))
"""


@needs_linear
def test_linear_work_of_threads_that_never_came_is_done_by_those_that_did():
    """Each of the kernel's threads starts on an equal share of the panels and, when done,
    steals from the others. Under OMP_THREAD_LIMIT=1 a call asking for 4 threads gets a team
    of one, which must then take the three unowned shares too: every output (bf16 and int8
    weights) as one thread computes it, none left unwritten (NaN)."""
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _STEAL_CHECK], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_THREAD_LIMIT": "1"})
    assert result.stdout.split("\n")[:3] == ["1", "0 True", "0 True"], result.stderr


@needs_linear
def test_linear_outputs_do_not_depend_on_the_thread_count():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(9, 64, generator=generator).bfloat16()
    packed = kernels.pack_linear_weight(torch.randn(1000, 64, generator=generator).bfloat16())
    outputs = []
    for count in (1, 2, 7):
        with num_threads(count):
            outputs.append(kernels.linear_bf16(x, packed, None, 1000, torch.float32))
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


@contextlib.contextmanager
def num_threads(count: int):
    """torch's (and so the kernels') thread count set to `count` for the block."""
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _reference_decode(q, k_cache, v_cache, tables, lens, scale, window):
    """Float64 softmax attention of each single-token query over its paged context."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = v_cache.shape
    group = num_heads // num_kv_heads
    keys_all = k_cache.permute(0, 3, 1, 2)  # [blocks, block_size, kv_heads, dim]
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in range(num_seqs):
        n = int(lens[s])
        positions = torch.arange(n)
        blocks, offsets = tables[s][positions // block_size], positions % block_size
        keys, values = keys_all[blocks, offsets].double(), v_cache[blocks, offsets].double()
        first = max(0, n - window) if window else 0
        for h in range(num_heads):
            kv = h // group
            scores = keys[first:, kv] @ q[s, h].double() * scale
            out[s, h] = torch.softmax(scores, 0) @ values[first:, kv]
    return out


def _paged_cache(lens, num_kv_heads, head_dim, block_size, dtype, generator):
    """NaN-filled caches with random keys and values written at each sequence's slots."""
    num_blocks = 1 + sum(-(-n // block_size) for n in lens)
    k_cache = torch.full((num_blocks, num_kv_heads, head_dim, block_size), math.nan,
                         dtype=dtype)
    v_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), math.nan,
                         dtype=dtype)
    tables = torch.zeros(len(lens), -(-max(lens) // block_size), dtype=torch.int64)
    free = torch.randperm(num_blocks - 1, generator=generator) + 1
    used = 0
    for s, n in enumerate(lens):
        count = -(-n // block_size)
        tables[s, :count] = free[used:used + count]
        used += count
        positions = torch.arange(n)
        blocks, offsets = tables[s][positions // block_size], positions % block_size
        k_cache.permute(0, 3, 1, 2)[blocks, offsets] = torch.randn(
            n, num_kv_heads, head_dim, generator=generator).to(dtype)
        v_cache[blocks, offsets] = torch.randn(n, num_kv_heads, head_dim,
                                               generator=generator).to(dtype)
    return k_cache, v_cache, tables


@pytest.mark.skipif(kernels.paged_attention() is None, reason="no C++ compiler")
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float32),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 16), (64, 32), (16, 16),
                                                 (48, 8)])
@pytest.mark.parametrize("group,window", [(3, 0), (1, 0), (4, 21)])
def test_paged_decode_attention_matches_float64(dtype, cache_dtype, head_dim, block_size,
                                                group, window):
    generator = torch.Generator().manual_seed(head_dim + block_size + group)
    num_kv_heads = 2
    lens = torch.tensor([1, 15, 16, 17, 33, 100, 130], dtype=torch.int64)
    k_cache, v_cache, tables = _paged_cache(lens.tolist(), num_kv_heads, head_dim, block_size,
                                            cache_dtype, generator)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=generator).to(dtype)
    scale = head_dim ** -0.5
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window)
    assert got.dtype == dtype and not got.isnan().any()
    reference = _reference_decode(q, k_cache, v_cache, tables, lens, scale, window)
    tolerance = 2e-2 if cache_dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double(), reference, atol=tolerance, rtol=tolerance)


def _slot_rows(k_cache, v_cache, tables, lens):
    """All written slots, and their [slots, kv_heads, head_dim] keys and values."""
    block_size = v_cache.shape[1]
    slots = torch.cat([tables[s][torch.arange(n) // block_size] * block_size
                       + torch.arange(n) % block_size for s, n in enumerate(lens)])
    blocks, offsets = slots // block_size, slots % block_size
    return slots, k_cache.permute(0, 3, 1, 2)[blocks, offsets], v_cache[blocks, offsets]


def _to_pair_layout(k_cache, v_cache, tables, lens):
    """The same cache contents in the varlen kernel's layout (unwritten slots NaN)."""
    num_blocks, num_kv_heads, head_dim, block_size = k_cache.shape
    k_shape, v_shape = kernels.varlen_cache_shapes(num_blocks, block_size, num_kv_heads,
                                                   head_dim)
    pair_k = torch.full(k_shape, math.nan, dtype=k_cache.dtype)
    pair_v = torch.full(v_shape, math.nan, dtype=v_cache.dtype)
    slots, keys, values = _slot_rows(k_cache, v_cache, tables, lens)
    kernels.write_kv_bf16(keys, values, pair_k, pair_v, slots)
    return pair_k, pair_v


@pytest.mark.skipif(not kernels.supports_varlen(torch.bfloat16, torch.bfloat16, 3, 64, 16),
                    reason="no AVX512-BF16 or AVX2 attention kernel on this machine")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group,window", [(3, 0), (1, 0), (7, 0), (3, 21)])
def test_paged_varlen_attention_matches_causal_float64(head_dim, group, window):
    """Decodes and prefill chunks of every length in one call: each query row sees exactly
    the context up to its own position."""
    generator = torch.Generator().manual_seed(head_dim * group + window)
    num_kv_heads, block_size = 2, 16
    # (context length after the step, new tokens): decodes, a fresh prompt, chunks on top
    # of cached context, chunks longer than a tile of rows.
    shapes = [(40, 1), (1, 1), (17, 17), (100, 33), (64, 5), (130, 70), (33, 1)]
    lens = [n for n, _ in shapes]
    k_cache, v_cache, tables = _paged_cache(lens, num_kv_heads, head_dim, block_size,
                                            torch.bfloat16, generator)
    pair_k, pair_v = _to_pair_layout(k_cache, v_cache, tables, lens)
    news = torch.tensor([q for _, q in shapes])
    query_start = torch.cat([torch.zeros(1, dtype=torch.int64), news.cumsum(0)])
    q = torch.randn(int(news.sum()), num_kv_heads * group, head_dim,
                    generator=generator).bfloat16()
    scale = head_dim ** -0.5
    got = kernels.paged_varlen_attention(q, pair_k, pair_v, tables, query_start,
                                         torch.tensor(lens), scale, window)
    assert not got.isnan().any()
    for s, (n, new) in enumerate(shapes):
        rows = slice(int(query_start[s]), int(query_start[s + 1]))
        # Row i is position n - new + i: as a decode, it sees the first n - new + i + 1 tokens.
        row_lens = torch.arange(n - new + 1, n + 1)
        reference = _reference_decode(q[rows], k_cache, v_cache,
                                      tables[s].expand(new, -1), row_lens, scale, window)
        torch.testing.assert_close(got[rows].double(), reference, atol=2e-2, rtol=2e-2)
    # The softmax takes the largest unscaled score as the largest scaled one: no other sign.
    with pytest.raises(RuntimeError, match="scale -"):
        kernels.paged_varlen_attention(q, pair_k, pair_v, tables, query_start,
                                       torch.tensor(lens), -scale, window)


@pytest.mark.skipif(not kernels.supports_varlen(torch.bfloat16, torch.bfloat16, 3, 64, 16),
                    reason="no AVX512-BF16 or AVX2 attention kernel on this machine")
@pytest.mark.parametrize("num_kv_heads", [3, 4])
@pytest.mark.parametrize("lens", [[70], [70, 33]])
def test_paged_varlen_attention_shares_few_decodes_out_by_head_and_reads_queries_in_place(
        num_kv_heads, lens):
    """With fewer decodes than threads and contexts too short to cut into pieces, each
    decode's KV heads are split between threads; the answer must not change with the thread
    count (bit for bit) and must match float64.
    Queries read in place from wider rows (the fused QKV output) give the same bits as a
    contiguous copy."""
    generator = torch.Generator().manual_seed(num_kv_heads + len(lens))
    group, head_dim, block_size = 3, 64, 16
    k_cache, v_cache, tables = _paged_cache(lens, num_kv_heads, head_dim, block_size,
                                            torch.bfloat16, generator)
    pair_k, pair_v = _to_pair_layout(k_cache, v_cache, tables, lens)
    q_size = num_kv_heads * group * head_dim
    qkv = torch.randn(len(lens), q_size + 2 * num_kv_heads * head_dim,
                      generator=generator).bfloat16()
    q = qkv[:, :q_size].view(len(lens), num_kv_heads * group, head_dim)
    query_start = torch.arange(len(lens) + 1)
    seq_lens, scale = torch.tensor(lens), head_dim ** -0.5
    got = {}
    for count in (1, 2, 4):
        with num_threads(count):
            got[count] = kernels.paged_varlen_attention(q, pair_k, pair_v, tables, query_start,
                                                        seq_lens, scale, 0)
    with num_threads(4):
        copied = kernels.paged_varlen_attention(q.contiguous(), pair_k, pair_v, tables,
                                                query_start, seq_lens, scale, 0)
    assert torch.equal(got[2], got[1]) and torch.equal(got[4], got[1])
    assert torch.equal(copied, got[1])
    reference = _reference_decode(q, k_cache, v_cache, tables, seq_lens, scale, 0)
    torch.testing.assert_close(got[2].double(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not kernels.supports_varlen(torch.bfloat16, torch.bfloat16, 3, 64, 16),
                    reason="no AVX512-BF16 or AVX2 attention kernel on this machine")
@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("window", [0, 300])
def test_paged_varlen_attention_splits_a_lone_long_decode_by_context(threads, window):
    """A lone decode with a long context is cut into pieces, one per thread (flash-decoding),
    whose softmax parts are merged by their log-sum-exp. Every visible token must count
    exactly once: with a zero query the scores are uniform and the output is the mean of
    the visible values, and here value dim d of a token is 1 when its position is d mod 64,
    so a token lost or counted twice at a piece's edge moves some dim by 1/5 or more. A
    random query must match float64 as well. A 300-token window starts inside a block."""
    generator = torch.Generator().manual_seed(threads + window)
    num_kv_heads, group, head_dim, n = 3, 3, 64, 1000
    k_cache, v_cache, tables = _paged_cache([n], num_kv_heads, head_dim, 16, torch.bfloat16,
                                            generator)
    positions = torch.arange(n)
    blocks, offsets = tables[0][positions // 16], positions % 16
    coded = (positions[:, None] % head_dim == torch.arange(head_dim)).to(torch.bfloat16)
    v_cache[blocks, offsets] = coded[:, None, :] * torch.tensor([1.0, 2.0, 3.0])[:, None].to(
        torch.bfloat16)
    pair_k, pair_v = _to_pair_layout(k_cache, v_cache, tables, [n])
    query_start, seq_lens, scale = torch.tensor([0, 1]), torch.tensor([n]), head_dim ** -0.5
    queries = {"zero": torch.zeros(1, num_kv_heads * group, head_dim).bfloat16(),
               "random": 4 * torch.randn(1, num_kv_heads * group, head_dim,
                                         generator=generator).bfloat16()}
    with num_threads(threads):
        got = {name: kernels.paged_varlen_attention(q, pair_k, pair_v, tables, query_start,
                                                    seq_lens, scale, window)
               for name, q in queries.items()}
    visible = positions[n - window:] if window else positions
    counts = (visible[:, None] % head_dim == torch.arange(head_dim)).sum(0).double()
    mean = counts / len(visible) * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)[:, None]
    expected = mean.repeat_interleave(group, dim=0)[None]
    torch.testing.assert_close(got["zero"].double(), expected, atol=0, rtol=1e-2)
    reference = _reference_decode(queries["random"], k_cache, v_cache, tables, seq_lens, scale,
                                  window)
    torch.testing.assert_close(got["random"].double(), reference, atol=2e-2, rtol=2e-2)


needs_elementwise = pytest.mark.skipif(
    not kernels.has_elementwise(),
    reason="no C++ compiler")


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


# One row (a lone decode) runs on the calling thread, more rows on a team: both are checked.
@needs_elementwise
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_bf16_matches_torch_rounding(with_residual, rows):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 576, generator=generator).bfloat16()
    weight = torch.randn(576, generator=generator).bfloat16()
    residual = torch.randn(rows, 576, generator=generator).bfloat16() if with_residual else None
    summed = x.float() if residual is None else _bf16(x.float() + residual.float())
    normed = _bf16(summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5))
    expected = (weight.float() * normed).bfloat16()
    got = kernels.rms_norm_bf16(x, weight, 1e-5, residual)
    torch.testing.assert_close(got.float(), expected.float(), atol=0, rtol=2e-2)  # 1 ulp
    if residual is not None:
        assert torch.equal(residual.float(), summed)  # the residual stream, updated in place


@needs_elementwise
@pytest.mark.parametrize("rows", [1, 5])
def test_silu_mul_and_rope_bf16_match_torch(rows):
    generator = torch.Generator().manual_seed(2)
    gate_up = torch.randn(rows + 4, 2 * 1536, generator=generator).bfloat16()
    gate, up = gate_up.float().chunk(2, -1)
    expected = _bf16(torch.nn.functional.silu(gate)) * up.float()
    torch.testing.assert_close(kernels.silu_mul_bf16(gate_up).float(), expected,
                               atol=1e-2, rtol=1e-2)
    qkv = torch.randn(rows, 3 * 64 + 2 * 64, generator=generator).bfloat16()
    q = qkv[:, :192].view(rows, 3, 64)  # a strided view into the fused QKV rows, as in a layer
    positions = torch.tensor([41, 7, 3, 100, 0][:rows])
    angles = torch.outer(torch.arange(128).float(), 1 / 10000 ** (torch.arange(0, 64, 2) / 64))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x = q.float()
    rotated = torch.cat([-x[..., 32:], x[..., :32]], -1)
    expected = x * cos[positions, None] + rotated * sin[positions, None]
    untouched = qkv[:, 192:].clone()
    kernels.rope_bf16_(q, positions, cos, sin)
    torch.testing.assert_close(q.float(), expected, atol=2e-2, rtol=1e-2)
    assert torch.equal(qkv[:, 192:], untouched)


@pytest.mark.skipif(kernels.paged_attention() is None, reason="no C++ compiler")
@pytest.mark.parametrize("tokens", [1, 6])
def test_write_kv_bf16_stores_each_slot_in_the_pair_layout(tokens):
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, 6 * 64, generator=generator).bfloat16()
    k, v = qkv[:, 128:256].view(tokens, 2, 64), qkv[:, 256:].view(tokens, 2, 64)  # strided
    slots = torch.tensor([17, 3, 18, 40, 0, 63][:tokens])
    k_shape, v_shape = kernels.varlen_cache_shapes(4, 16, 2, 64)
    k_cache = torch.zeros(k_shape, dtype=torch.bfloat16)
    v_cache = torch.zeros(v_shape, dtype=torch.bfloat16)
    kernels.write_kv_bf16(k, v, k_cache, v_cache, slots)
    blocks, offsets = slots // 16, slots % 16
    # keys [B, H, D/2, 16, 2] -> [B, 16, H, D]; values [B, H, 8, D, 2] -> [B, 16, H, D]
    keys = k_cache.permute(0, 3, 1, 2, 4).reshape(4, 16, 2, 64)
    values = v_cache.permute(0, 2, 4, 1, 3).reshape(4, 16, 2, 64)
    assert torch.equal(keys[blocks, offsets], k)
    assert torch.equal(values[blocks, offsets], v)
    assert int((keys != 0).any(-1).any(-1).sum()) == len(slots)  # nothing else written


@pytest.mark.skipif(kernels._sampling_library() is None, reason="no C++ compiler")
@pytest.mark.parametrize("rows,vocab", [(2, 49152), (7, 1000), (64, 4099), (3, 1)])
def test_argmax_matches_torch_on_random_rows_ties_and_strided_rows(rows, vocab):
    generator = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab + 5, generator=generator)[:, 2:vocab + 2]  # strided rows
    logits[0, vocab // 2:] = logits[0].max() + 1  # a tie of many: the first wins
    logits[-1, -1] = 1e9  # the very last column
    got = kernels.argmax(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))
    assert int(got[0]) == vocab // 2 and int(got[-1]) == vocab - 1
    assert torch.equal(kernels.argmax(logits[1:2]), got[1:2])  # one row: no threads


@pytest.mark.skipif(kernels._sampling_library() is None, reason="no C++ compiler")
def test_argmax_orders_nan_infinities_and_signed_zeros_as_torch_does():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, nan, 3.0, nan, 5.0], [-inf] * 5, [2.0, 5.0, 5.0, 1.0, 5.0],
                           [-0.0, 0.0, -1.0, -0.0, 0.0], [-3.0, -1.0, -2.0, -1.0, -5.0],
                           [-1.0, 2.0, inf, inf, nan], [-inf, -1e-45, -0.0, -1e-45, -inf]])
    logits[5, 0] = -nan  # a NaN with the sign bit set counts as NaN too
    assert kernels.argmax(logits).tolist() == logits.argmax(dim=-1).tolist() \
        == [1, 0, 1, 0, 1, 0, 2]


@pytest.mark.skipif(kernels._sampling_library() is None, reason="no C++ compiler")
def test_sample_reads_strided_rows_and_draws_nothing_where_nothing_can_be_drawn():
    """-1 (the sampler then names whose fault it is) for a NaN, a +inf, no finite logit, or a
    logit that the temperature scales out of float32's range; a lone finite token in a
    vector's tail is drawn at any u; rows a stride apart."""
    nan, inf = float("nan"), float("inf")
    logits = torch.full((6, 14), -inf)[:, 1:12]  # 11 columns: a tail past 8 lanes
    logits[0, 10] = 2.0
    logits[1] = 0.0
    logits[1, 5] = nan
    logits[2] = 1.0
    logits[2, 6] = inf
    logits[4, 7] = 1e38  # / 1e-5: +inf
    logits[5, :3] = torch.tensor([1.0, 1.0, 1.0])
    for u in (0.0, 0.5, 1 - 2 ** -53):
        got = kernels.sample(logits, [1.0] * 4 + [1e-5, 1.0], [0.0] * 6, [0] * 6, [1.0] * 6,
                             torch.full((6, 1), u, dtype=torch.float64))
        assert got.tolist() == [10, -1, -1, -1, -1, min(int(3 * u), 2)]


def test_loading_the_kernels_leaves_the_process_floating_point_mode_alone():
    """A library linked with -ffast-math would switch the whole process to flush-to-zero."""
    import subprocess
    import sys

    code = ("import torch; from fulcrum import kernels; kernels.paged_attention(); "
            "kernels.has_elementwise(); kernels.argmax(torch.zeros(2, 3)); "
            "kernels.sample(torch.zeros(1, 3), [1.0], [0.0], [0], [1.0], "
            "torch.zeros(1, 1, dtype=torch.float64)); "
            "print(torch.tensor(1e-40, dtype=torch.float32).item() > 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.stdout.strip() == "True", result.stderr
