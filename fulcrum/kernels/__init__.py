"""Native CPU kernels: compiled at first use with the system C++ compiler, loaded with ctypes.

- paged_attention.cpp: attention reading the paged KV cache in place (decodes; in bf16
  whole steps, prefill chunks too);
- linear_bf16.cpp: bfloat16 and int8 linear layers over weights packed once, on
  AVX512-BF16 and VNNI CPUs or, widening the weights in registers, on AVX2 and FMA ones;
- elementwise_bf16.cpp: residual add + RMSNorm, SiLU * up and RoPE, each in one pass;
- sampling.cpp: greedy sampling's argmax over fp32 logits, vectorised, random sampling
  (temperature, min_p, top_k, top_p) sorting only the tokens near the filters' cut, and
  logprobs (a token's, its rank, the most likely) without writing the log-softmax out.

No torch headers are involved, so a build takes a second or two; each shared object is
cached under $FULCRUM_CACHE/kernels (default ~/.cache/fulcrum/kernels), keyed by the source
and the headers beside it, the compiler and this CPU's instruction-set flags. Where no
compiler is found, the build fails or the CPU lacks the instructions, the portable torch
path is used instead. Set FULCRUM_DISABLE_KERNELS=1 to force the torch path.

The kernels are linked with -fopenmp; their libgomp.so.1 resolves to the one torch has
already loaded, so all share one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent
# -ffast-math's parts, not the flag itself: with -ffast-math, GCC before 13 links
# crtfastmath.o into shared objects too, and loading the kernels would then switch the whole
# process to flush-to-zero arithmetic (numpy, torch and the caller's own code included).
FAST_MATH = ["-fno-math-errno", "-fno-trapping-math", "-ffinite-math-only", "-fno-signed-zeros",
             "-fassociative-math", "-freciprocal-math"]
FLAGS = ["-O3", "-march=native", *FAST_MATH, "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build(source: Path, compiler: str) -> Path:
    headers = [h.read_bytes() for h in sorted(KERNEL_DIR.glob("*.h"))]
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, compiler.encode(),
                                     " ".join(FLAGS).encode(), _cpu_flags().encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    root = Path(os.environ.get("FULCRUM_CACHE", Path.home() / ".cache" / "fulcrum"))
    target = root / "kernels" / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(source), "-o", str(built)], check=True,
                       capture_output=True, text=True)
        os.replace(built, target)  # atomic: concurrent builders agree on one file
    return target


def compiler() -> Optional[str]:
    """The C++ compiler the kernels are built with ($CXX, else g++), or None if not found."""
    return shutil.which(os.environ.get("CXX", "g++"))


@functools.lru_cache(maxsize=None)
def _library(name: str) -> Optional[ctypes.CDLL]:
    """The compiled kernels/<name>.cpp, or None (disabled, no compiler, build failed)."""
    if os.environ.get("FULCRUM_DISABLE_KERNELS") == "1":
        return None
    found = compiler()
    if found is None:
        logger.warning("no C++ compiler found: using torch for %s", name)
        return None
    try:
        return ctypes.CDLL(str(_build(KERNEL_DIR / f"{name}.cpp", found)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("could not build the CPU kernel %s (%s): using torch", name, detail)
        return None


def clear_cache() -> None:
    """Forget loaded kernels, so FULCRUM_DISABLE_KERNELS is read again (tests flip it)."""
    for cached in (_library, paged_attention, _linear_library, _elementwise_library,
                   shm_collectives, _sampling_library):
        cached.cache_clear()


def _declare(library: ctypes.CDLL, name: str, argtypes: list) -> None:
    function = getattr(library, name)
    function.restype = ctypes.c_int
    function.argtypes = argtypes


@functools.lru_cache(maxsize=None)
def paged_attention() -> Optional[ctypes.CDLL]:
    library = _library("paged_attention")
    if library is not None:
        pointer, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        for name in _ENTRY.values():
            _declare(library, name, [pointer] * 6 + [i32] * 6 + [f32, i32, i32])
        i64 = ctypes.c_int64
        _declare(library, "paged_varlen_attention_bf16",
                 [pointer, i64] + [pointer] * 6 + [i32] * 6 + [f32, i32, i32])
        _declare(library, "paged_write_kv_bf16",
                 [pointer, i64, pointer, i64, pointer, pointer, pointer] + [i32] * 4)
    return library


@functools.lru_cache(maxsize=None)
def shm_collectives() -> Optional[ctypes.CDLL]:
    """The bf16 all-reduce through shared memory (fulcrum/distributed/shm.py's layout)."""
    library = _library("shm_collectives")
    if library is not None:
        _declare(library, "fulcrum_shm_all_reduce_bf16",
                 [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64])
    return library


# (query dtype, cache dtype) -> entry point.
_ENTRY = {(torch.float32, torch.float32): "paged_decode_attention_f32_f32",
          (torch.float32, torch.bfloat16): "paged_decode_attention_f32_bf16",
          (torch.bfloat16, torch.bfloat16): "paged_decode_attention_bf16_bf16"}


def supports(dtype: torch.dtype, cache_dtype: torch.dtype, group_size: int, head_dim: int,
             block_size: int) -> bool:
    """Whether the kernel can run this case (its stack buffers bound the shape)."""
    return ((dtype, cache_dtype) in _ENTRY and group_size <= 16 and head_dim <= 256
            and block_size <= 128 and paged_attention() is not None)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int) -> torch.Tensor:
    """q: [B, Hq, D], one token per sequence; caches in attention.py's layouts."""
    q = q.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = v_cache.shape
    getattr(paged_attention(), _ENTRY[q.dtype, k_cache.dtype])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
        block_size, block_tables.shape[1], scale, window, torch.get_num_threads())
    return out


# The block size of the bf16 varlen attention kernel (paged_attention.cpp's kBlock).
VARLEN_BLOCK_SIZE = 16


def supports_varlen(dtype: torch.dtype, cache_dtype: torch.dtype, group_size: int,
                    head_dim: int, block_size: int) -> bool:
    """Whether `paged_varlen_attention` runs this case (bf16, 16-token blocks, head 64/128,
    a CPU with AVX512-BF16 or AVX2 and FMA)."""
    return (dtype == cache_dtype == torch.bfloat16 and block_size == VARLEN_BLOCK_SIZE
            and head_dim in (64, 128) and group_size <= 32 and paged_attention() is not None
            and paged_attention().paged_varlen_attention_bf16_supported() == 1)


def varlen_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int,
                        head_dim: int) -> tuple:
    """(key, value) cache shapes of the bf16 varlen kernel: keys [blocks, kv_heads, head_dim
    / 2, block_size, 2] and values [blocks, kv_heads, block_size / 2, head_dim, 2], the
    operand order of the CPU's bf16 dot-product instruction (see paged_attention.cpp)."""
    return ((num_blocks, num_kv_heads, head_dim // 2, block_size, 2),
            (num_blocks, num_kv_heads, block_size // 2, head_dim, 2))


def _heads_contiguous(x: torch.Tensor) -> bool:
    """Whether each token's [heads, head_dim] of x [T, heads, head_dim] is one contiguous run
    (tokens may be any stride apart: views into the fused QKV output qualify)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def write_kv_bf16(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] (bf16; each token's heads contiguous, tokens any
    stride) at their slots of the caches, in `paged_varlen_attention`'s pair layouts."""
    tokens, num_kv_heads, head_dim = k.shape
    if not (_heads_contiguous(k) and _heads_contiguous(v)):
        raise ValueError("write_kv_bf16 needs each token's heads contiguous")
    paged_attention().paged_write_kv_bf16(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), slot_mapping.data_ptr(), tokens, num_kv_heads, head_dim,
        torch.get_num_threads())


def paged_varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """q: [T, Hq, D], the step's query tokens grouped by sequence (`query_start`, [S + 1]);
    sequence s's rows are the newest tokens of its seq_lens[s]-token context. Each token's
    heads contiguous, tokens any stride (a view into the fused QKV output is read in place).
    Caches in the pair layouts of `varlen_cache_shapes`."""
    tokens, num_heads, head_dim = q.shape
    if not _heads_contiguous(q):
        q = q.contiguous()
    out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[3]
    status = paged_attention().paged_varlen_attention_bf16(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), query_start.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
        seq_lens.shape[0],
        num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1], scale, window,
        torch.get_num_threads())
    if status:
        raise RuntimeError(f"paged_varlen_attention has no kernel for {tuple(q.shape)}, "
                           f"block size {block_size}, scale {scale}")
    return out


# ----------------------------------------------------------------- bf16 linear
@functools.lru_cache(maxsize=None)
def _linear_library() -> Optional[ctypes.CDLL]:
    library = _library("linear_bf16")
    if library is None or not library.fulcrum_linear_bf16_supported():
        return None
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    _declare(library, "fulcrum_linear_bf16",
             [pointer, i64, pointer, pointer, pointer, i64] + [i32] * 5)
    _declare(library, "fulcrum_linear_int8",
             [pointer, i64, pointer, pointer, pointer, pointer, i64] + [i32] * 5)
    return library


def instruction_set() -> str:
    """Which build of the bf16 kernels this CPU runs: "avx512-bf16", "avx2", or "torch" (none:
    the portable path). Benchmarks record it, since their figures depend on it."""
    library = _library("linear_bf16")
    if library is None:
        return "torch"
    library.fulcrum_linear_bf16_isa.restype = ctypes.c_char_p
    isa = library.fulcrum_linear_bf16_isa().decode()
    return "torch" if isa == "none" else isa


def supports_linear(weight: torch.Tensor) -> bool:
    """Whether `weight` ([out, in]) can run through the packed bf16 kernel."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape[1] % 2 == 0 and _linear_library() is not None)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the kernel's panels, zero-padded. bf16: [panels, in / 2, panel width, 2].
    int8 (from `quantize_int8`): each panel holds quads of inputs, [in / 4, panel width, 4]
    (in padded to whole quads), then its columns' weight sums times 128 (int32) for the
    kernel's unsigned activations; flattened to [panels, bytes]."""
    panel = _linear_library().fulcrum_linear_bf16_panel()
    group = 4 if weight.dtype == torch.int8 else 2
    out_features, in_features = weight.shape
    padded_out = -(-out_features // panel) * panel
    padded_in = -(-in_features // group) * group
    full = torch.zeros(padded_out, padded_in, dtype=weight.dtype, device=weight.device)
    full[:out_features, :in_features] = weight
    panels = full.view(padded_out // panel, panel, padded_in // group, group).permute(0, 2, 1, 3)
    if group == 2:
        return panels.contiguous()
    sums = (full.sum(dim=1, dtype=torch.int32) * 128).view(-1, panel).contiguous().view(torch.int8)
    return torch.cat([panels.reshape(padded_out // panel, -1), sums], dim=1)


HUGE_PAGE = 2 << 20


def huge_page_tensor(nbytes: int) -> torch.Tensor:
    """`nbytes` of CPU memory (uint8) on 2 MiB pages where Linux allows it (transparent huge
    pages, asked for with madvise before the memory is first touched), else on ordinary ones.

    Why: a decode step streams every weight once, and attention reads KV blocks all over the
    cache. On 4 KiB pages each page costs a TLB miss and the hardware prefetchers stop at its
    edge, so a core's stream stalls every 4 KiB; on 2 MiB pages it runs on (`fulcrum bench
    latency` measures the bandwidth on such pages too)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    # whole huge pages from an aligned start: room for one more than `nbytes` needs
    length = (-(-nbytes // HUGE_PAGE) + 1) * HUGE_PAGE
    # private: a shared anonymous mapping is shmem, which has huge pages of its own setting
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages: ordinary pages
        pass
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip:skip + nbytes]


def huge_page_tensors(layout: Sequence[Tuple[Sequence[int], torch.dtype]]) -> List[torch.Tensor]:
    """Uninitialised CPU tensors of `layout`'s (shape, dtype)s side by side, in order (each at
    a 64-byte boundary), in one `huge_page_tensor`."""
    sizes = [-(-math.prod(shape) * dtype.itemsize // 64) * 64 for shape, dtype in layout]
    arena = huge_page_tensor(sum(sizes))
    tensors, offset = [], 0
    for (shape, dtype), size in zip(layout, sizes):
        nbytes = math.prod(shape) * dtype.itemsize
        tensors.append(arena[offset:offset + nbytes].view(dtype).view(shape))
        offset += size
    return tensors


def quantize_int8(weight: torch.Tensor) -> tuple:
    """int8 with one scale per output channel: (q [out, in] int8, scale [out] fp32) with
    weight ~= scale[:, None] * q, |q| <= 127 (symmetric, rounded to nearest)."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_rows_int8(x: torch.Tensor) -> tuple:
    """The int8 kernel's dynamic activation quantization, one scale per row: (q as float32,
    scale [..., 1]) with q = round-half-even(x * (127 / amax)), x ~= q * amax / 127."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # torch.div, not 127.0 / amax: torch computes the latter as 127 * (1 / amax), which may
    # differ from the kernel's division in the last bit and round a q differently
    inverse = torch.where(amax > 0, torch.div(torch.full_like(amax, 127.0), amax),
                          torch.zeros_like(amax))
    return torch.round(x * inverse), amax / 127.0


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                out_features: int, out_dtype: torch.dtype = torch.bfloat16,
                scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., in] (bf16) @ W^T + bias, with W packed by `pack_linear_weight`; bias fp32.
    With int8 panels, `scale` ([out] fp32, one per output channel) makes W = scale * q, and
    each row of x is quantized as `quantize_rows_int8` does."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1 or rows.dtype != torch.bfloat16:
        rows = rows.to(torch.bfloat16).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=out_dtype, device=rows.device)
    library = _linear_library()
    common = (out.data_ptr(), out.stride(0), rows.shape[0], out_features, rows.shape[1],
              int(out_dtype == torch.float32), torch.get_num_threads())
    bias_ptr = None if bias is None else bias.data_ptr()
    if packed.dtype == torch.int8:
        status = library.fulcrum_linear_int8(rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                                             scale.data_ptr(), bias_ptr, *common)
    else:
        status = library.fulcrum_linear_bf16(rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                                             bias_ptr, *common)
    if status:
        raise RuntimeError(f"linear kernel failed on shape {tuple(rows.shape)}")
    return out.view(*x.shape[:-1], out_features)


# ------------------------------------------------------------ bf16 elementwise
@functools.lru_cache(maxsize=None)
def _elementwise_library() -> Optional[ctypes.CDLL]:
    library = _library("elementwise_bf16")
    if library is None:
        return None
    pointer, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    _declare(library, "fulcrum_rms_norm_bf16",
             [pointer, i64, pointer, pointer, pointer, i64, i32, i32, f32, i32])
    _declare(library, "fulcrum_silu_mul_bf16", [pointer, pointer, i32, i32, i32])
    _declare(library, "fulcrum_rope_bf16",
             [pointer, i64, pointer, pointer, pointer, i32, i32, i32, i32])
    return library


def has_elementwise() -> bool:
    """Whether the fused bf16 elementwise kernels are built (any CPU with a compiler)."""
    return _elementwise_library() is not None


def supports_elementwise(x: torch.Tensor) -> bool:
    """Whether the fused bf16 kernels take `x` (bf16 on CPU, rows of contiguous values)."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.stride(-1) == 1
            and has_elementwise())


def _check(status: int, name: str) -> None:
    if status:
        raise RuntimeError(f"{name} kernel failed")


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm(x) * weight; with `residual`, first residual += x in place and normalise that.
    x: [..., width], each row contiguous; residual contiguous, of x's shape."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)  # a view where the strides allow, else a copy
    out = torch.empty(rows.shape, dtype=torch.bfloat16, device=rows.device)
    _check(_elementwise_library().fulcrum_rms_norm_bf16(
        rows.data_ptr(), rows.stride(0), None if residual is None else residual.data_ptr(),
        weight.data_ptr(), out.data_ptr(), out.stride(0), rows.shape[0], width, eps,
        torch.get_num_threads()), "rms_norm_bf16")
    return out.view(x.shape)


def silu_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2 * width] (gate first), contiguous."""
    gate_up = gate_up.contiguous()
    width = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], width, dtype=torch.bfloat16, device=gate_up.device)
    _check(_elementwise_library().fulcrum_silu_mul_bf16(
        gate_up.data_ptr(), out.data_ptr(), out.numel() // max(width, 1), width,
        torch.get_num_threads()), "silu_mul_bf16")
    return out


def rope_bf16_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, head_dim] in place (each [heads, head_dim] row
    contiguous, rows any stride); cos/sin: fp32 [positions, head_dim] tables."""
    tokens, heads, head_dim = x.shape
    _check(_elementwise_library().fulcrum_rope_bf16(
        x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens,
        heads, head_dim, torch.get_num_threads()), "rope_bf16")
    return x


# -------------------------------------------------------------------- sampling
@functools.lru_cache(maxsize=None)
def _sampling_library() -> Optional[ctypes.CDLL]:
    library = _library("sampling")
    if library is not None:
        declare_sampling(library)
    return library


def declare_sampling(library: ctypes.CDLL) -> None:
    """The argument types of a build of sampling.cpp (tests load a portable one too)."""
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    _declare(library, "fulcrum_argmax_f32", [pointer, i64, i32, i32, pointer, i32])
    _declare(library, "fulcrum_sample_f32", [pointer, i64, i32, i32] + [pointer] * 6 + [i32])
    _declare(library, "fulcrum_logprobs_f32",
             [pointer, i64, i32, i32, pointer, i32] + [pointer] * 5 + [i32])


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of fp32 rows [rows, vocab] on CPU (the same indices:
    first of equal maxima, NaN largest), vectorised; torch's own elsewhere."""
    if not can_sample(logits):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _check(_sampling_library().fulcrum_argmax_f32(
        logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr(),
        torch.get_num_threads()), "argmax")
    return out


def can_sample(logits: torch.Tensor) -> bool:
    """Whether `sample` and `argmax` run these logits natively (fp32 rows [rows, vocab]
    on CPU)."""
    return (logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
            and logits.stride(1) == 1 and logits.shape[1] > 0
            and _sampling_library() is not None)


def sample(logits: torch.Tensor, temperature: Sequence[float], min_p: Sequence[float],
           top_k: Sequence[int], top_p: Sequence[float], u: torch.Tensor) -> torch.Tensor:
    """Each row's token drawn at its uniform u (float64 [rows, 1]) from softmax(logits / T)
    after min_p, top_k (<= 0 or >= vocab: off) and top_p, by the torch path's rules (see
    sampling.cpp); -1 for a row with nothing to sample."""
    rows, vocab = logits.shape
    device = logits.device  # not the default device, which may be another
    out = torch.empty(rows, dtype=torch.int64, device=device)
    floats = functools.partial(torch.tensor, dtype=torch.float32, device=device)
    temperature, min_p, top_p = floats(temperature), floats(min_p), floats(top_p)
    top_k = torch.tensor([k if 0 < k < vocab else 0 for k in top_k], dtype=torch.int64,
                         device=device)
    u = u.to(device=device, dtype=torch.float64).contiguous()
    _check(_sampling_library().fulcrum_sample_f32(
        logits.data_ptr(), logits.stride(0), rows, vocab, temperature.data_ptr(),
        min_p.data_ptr(), top_k.data_ptr(), top_p.data_ptr(), u.data_ptr(), out.data_ptr(),
        torch.get_num_threads()), "sample")
    return out


def logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: int
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows of fp32 logits ([rows, vocab], `can_sample`): each row's log-softmax at its
    token, that token's rank (1: the most likely), its `num_top` most likely tokens' ids and
    log-softmax, best first (of equal logits the lower id first), and whether the row was
    answered (False where it holds a NaN or +inf logit or none finite, or its token is
    outside the vocabulary, which torch's gather then refuses): what torch's
    log_softmax, a comparison and topk give, in two passes over each row."""
    rows, vocab = logits.shape
    device = logits.device
    tokens = torch.tensor(token_ids, dtype=torch.int64, device=device)
    chosen = torch.empty(rows, dtype=torch.float32, device=device)
    ranks = torch.empty(rows, dtype=torch.int64, device=device)
    top_values = torch.empty(rows, num_top, dtype=torch.float32, device=device)
    top_ids = torch.empty(rows, num_top, dtype=torch.int64, device=device)
    answered = torch.empty(rows, dtype=torch.int32, device=device)
    _check(_sampling_library().fulcrum_logprobs_f32(
        logits.data_ptr(), logits.stride(0), rows, vocab, tokens.data_ptr(), num_top,
        chosen.data_ptr(), ranks.data_ptr(), top_values.data_ptr(), top_ids.data_ptr(),
        answered.data_ptr(), torch.get_num_threads()), "logprobs")
    return chosen, ranks, top_values, top_ids, answered.bool()
