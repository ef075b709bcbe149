"""Native CPU kernels: compiled at first use with the system C++ compiler, loaded with ctypes.

No torch headers are involved, so a build takes about a second; the shared object is cached
under $FULCRUM_CACHE/kernels (default ~/.cache/fulcrum/kernels), keyed by the source, the
compiler and this CPU's instruction-set flags. Where no compiler is found, or the build
fails, `paged_attention()` returns None and the portable torch path is used instead. Set
FULCRUM_DISABLE_KERNELS=1 to force the torch path.

The kernel is linked with -fopenmp; its libgomp.so.1 resolves to the one torch has already
loaded, so both share one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build(compiler: str) -> Path:
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), compiler.encode(),
                                     " ".join(FLAGS).encode(), _cpu_flags().encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    root = Path(os.environ.get("FULCRUM_CACHE", Path.home() / ".cache" / "fulcrum"))
    target = root / "kernels" / f"paged_attention-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True,
                       capture_output=True, text=True)
        os.replace(built, target)  # atomic: concurrent builders agree on one file
    return target


@functools.lru_cache(maxsize=None)
def paged_attention() -> Optional[ctypes.CDLL]:
    if os.environ.get("FULCRUM_DISABLE_KERNELS") == "1":
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        logger.warning("no C++ compiler found: using the torch attention path")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("could not build the CPU attention kernel (%s): using torch", detail)
        return None
    pointer, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    for name in _ENTRY.values():
        function = getattr(library, name)
        function.restype = i32
        function.argtypes = [pointer] * 6 + [i32] * 6 + [f32, i32, i32]
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
