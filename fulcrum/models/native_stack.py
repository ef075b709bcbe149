"""The decoder stack of a step in one native call (fulcrum/kernels/decoder_stack.cpp).

Used where every piece has its native kernel: bf16 on a CPU with AVX512-BF16 or AVX2, the
varlen attention backend and packed linear layers (bf16 or int8). It runs the
same kernels in the same order as the Python layers, so its outputs are the same bit for bit;
what it saves is the Python between ~12 kernel calls a layer (and around the embedding lookup
and the final norm), which at batch 1 costs about as much as reading the weights.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, List, Optional, Tuple

import torch

from fulcrum import kernels
from fulcrum.distributed.shm import SLOT_BYTES

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("linear", "linear_int8", "rms_norm", "rms_norm_heads",
                                        "silu_mul", "rope",
                                        "write_kv", "attention", "all_reduce",
                                        "all_reduce_group", "argmax")]


class _Projection(ctypes.Structure):
    _fields_ = [("packed", _P), ("scale", _P), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection),
                ("down", _Projection), ("input_norm", _P), ("post_norm", _P),
                ("k_cache", _P), ("v_cache", _P), ("q_norm", _P), ("k_norm", _P)]


class _Dims(ctypes.Structure):
    _fields_ = [("vocab_start", ctypes.c_int64), ("vocab_end", ctypes.c_int64),
                ("head", _Projection), ("vocab", _I)] + [
        (name, _I) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                "intermediate", "block_size", "max_blocks", "window",
                                "num_threads")] + [("eps", _F), ("scale", _F)]


class _Step(ctypes.Structure):
    _fields_ = [("num_tokens", _I), ("num_seqs", _I)] + [
        (name, _P) for name in ("token_ids", "embedding", "final_norm", "normed", "hidden",
                                "residual", "qkv", "attn", "gate_up", "act", "positions",
                                "cos", "sin", "slots", "tables", "query_start", "seq_lens",
                                "logits", "argmax", "logit_rows")] + [
        ("num_logit_rows", _I), ("kernel_seconds", _P)]


# The kinds of kernel `NativeStack.kernel_seconds` splits the time into (decoder_stack.cpp's
# KernelKind): the norms (input, post-attention and final; Qwen3's q/k norms), the
# projections, RoPE, the KV write, attention, the all-reduces under tensor parallelism,
# SiLU * up, and the LM head with its argmax.
KERNEL_KINDS = ("rms_norm", "qkv_proj", "rope", "write_kv", "attention", "o_proj",
                "all_reduce", "gate_up_proj", "silu_mul", "down_proj", "lm_head")


@functools.lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    library = kernels._library("decoder_stack")
    if library is not None:
        library.fulcrum_decoder_stack.restype = ctypes.c_int
        library.fulcrum_decoder_stack.argtypes = [_P] * 4
    return library


def _entry(library: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(library, name), ctypes.c_void_p).value


def _projection(linear: Any) -> _Projection:
    return _Projection(linear.packed.data_ptr(),
                       None if linear.scale is None else linear.scale.data_ptr(),
                       None if linear.packed_bias is None else linear.packed_bias.data_ptr())


def _head_norms(attention: Any) -> Tuple[Optional[int], Optional[int]]:
    """The q and k heads' RMSNorm weights (Qwen3), or None for both."""
    if attention.q_norm is None:
        return None, None
    return attention.q_norm.weight.data_ptr(), attention.k_norm.weight.data_ptr()


class NativeStack:
    """`model`'s layers as one native call; build with `NativeStack.for_model`."""

    def __init__(self, model: Any, library: ctypes.CDLL,
                 all_reduce: Optional[Tuple[int, int]] = None, head: Any = None) -> None:
        """`all_reduce`: (the native bf16 all-reduce, its group) under tensor parallelism;
        `head`: the packed LM head `with_logits` ends with (None: it cannot be called)."""
        spec = model.layers[0].self_attn
        self.model, self.library, self.head = model, library, head
        linear, elementwise, attention, argmax = (
            kernels._linear_library(), kernels._elementwise_library(),
            kernels.paged_attention(), kernels._sampling_library())
        self.kernels = _Kernels(
            _entry(linear, "fulcrum_linear_bf16"), _entry(linear, "fulcrum_linear_int8"),
            _entry(elementwise, "fulcrum_rms_norm_bf16"),
            _entry(elementwise, "fulcrum_rms_norm_heads_bf16"),
            _entry(elementwise, "fulcrum_silu_mul_bf16"), _entry(elementwise, "fulcrum_rope_bf16"),
            _entry(attention, "paged_write_kv_bf16"),
            _entry(attention, "paged_varlen_attention_bf16"), *(all_reduce or (None, None)),
            None if argmax is None else _entry(argmax, "fulcrum_argmax_f32"))
        self.reduces = all_reduce is not None
        first = model.layers[0]
        self.dims = dict(num_layers=len(model.layers), hidden=first.mlp.down_proj.out_features,
                         num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                         head_dim=spec.head_dim,
                         intermediate=first.mlp.down_proj.in_features,
                         eps=first.input_layernorm.eps, scale=spec.scale)
        q_size = spec.num_heads * spec.head_dim
        hidden, intermediate = self.dims["hidden"], self.dims["intermediate"]
        # The step's scratch (hidden, residual, qkv, attn, gate_up, act) is one allocation:
        # where each part starts, in elements per token, 64-byte aligned.
        widths = (hidden, hidden, q_size + 2 * spec.num_kv_heads * spec.head_dim, q_size,
                  2 * intermediate, intermediate)
        padded = [-(-w // 32) * 32 for w in widths]
        self._offsets = [sum(padded[:i]) for i in range(len(padded))]
        self._scratch_width = sum(padded)
        self._layers: Optional[ctypes.Array] = None
        self._caches: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None
        # The last single-token step's inputs, outputs and call arguments (see `with_logits`).
        self._kept: Optional[Tuple[tuple, tuple, tuple]] = None  # (inputs, outputs, arguments)
        self.kernel_seconds: Optional[torch.Tensor] = None

    def time_kernels(self) -> torch.Tensor:
        """From the next call on, add each kind of kernel's wall time (seconds, float64, in
        the order of KERNEL_KINDS) to the returned tensor: where a step's time goes, for a
        profile (benchmarks/stack_profile.py). Each kernel call then reads the clock twice."""
        self.kernel_seconds = torch.zeros(len(KERNEL_KINDS), dtype=torch.float64)
        self._kept = None  # kept arguments point at no (or another) tensor
        return self.kernel_seconds

    @classmethod
    def for_model(cls, model: Any, backend: Any, group: Any = None,
                  head: Any = None) -> Optional["NativeStack"]:
        """A NativeStack if every piece of `model` (a DecoderModel) has its kernel (and, with
        a tensor-parallel `group`, a native all-reduce between its ranks), else None. The LM
        `head` joins it on one rank, if packed (a rank's share of it needs a gather)."""
        from fulcrum.models.attention import CpuVarlenAttentionBackend

        layers = model.layers
        linears = [m for layer in layers for m in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)]
        if (not isinstance(backend, CpuVarlenAttentionBackend) or not kernels.has_elementwise()
                or any(m.packed is None for m in linears)
                or model.norm.weight.dtype != torch.bfloat16
                or model.embed_tokens.weight.dtype != torch.bfloat16
                or not model.embed_tokens.weight.is_contiguous()):
            return None
        all_reduce = None
        if group is not None:
            all_reduce = group.shm.native() if group.shm is not None else None
            if all_reduce is None:
                return None
        library = _library()
        head = head if group is None and head is not None and head.packed is not None else None
        return None if library is None else cls(model, library, all_reduce, head)

    def fits(self, tokens: int) -> bool:
        """Whether a step of `tokens` rows fits (a reduced tensor must fit a shared slot)."""
        return not self.reduces or tokens * self.dims["hidden"] * 2 <= SLOT_BYTES

    def _layer_table(self, kv_caches: List[Tuple[torch.Tensor, torch.Tensor]]) -> ctypes.Array:
        # A runner hands the same list, never changed, every step; another list rebuilds.
        if kv_caches is not self._caches:
            self._caches = kv_caches
            self._layers = (_Layer * len(self.model.layers))(*[
                _Layer(_projection(layer.self_attn.qkv_proj), _projection(layer.self_attn.o_proj),
                       _projection(layer.mlp.gate_up_proj), _projection(layer.mlp.down_proj),
                       layer.input_layernorm.weight.data_ptr(),
                       layer.post_attention_layernorm.weight.data_ptr(),
                       cache[0].data_ptr(), cache[1].data_ptr(),
                       *_head_norms(layer.self_attn))
                for layer, cache in zip(self.model.layers, kv_caches)])
        return self._layers

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: List[Tuple[torch.Tensor, torch.Tensor]],
                 meta: Any) -> torch.Tensor:
        """The final norm's output [T, H] for the tokens `input_ids` [T]."""
        outputs, arguments = self._prepare(input_ids, positions, kv_caches, meta, None, False)
        self._run(arguments)
        return outputs[0]

    def with_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    kv_caches: List[Tuple[torch.Tensor, torch.Tensor]], meta: Any,
                    logits_rows: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        """(the final norm's output, the head's fp32 logits of `logits_rows` (None: every
        row) and each one's argmax; both None where no row samples), in one call. A step where
        every sequence has one token keeps its buffers and arguments: called next with the
        very same tensors (as the runner's decode steps of one shape are), it reuses them, so
        what it returned is overwritten then."""
        key = (input_ids, positions, meta, kv_caches, logits_rows, torch.get_num_threads())
        kept = self._kept
        if kept is not None and all(a is b for a, b in zip(kept[0][:5], key[:5])) \
                and kept[0][5] == key[5]:
            self._run(kept[2])
            return kept[1]
        outputs, arguments = self._prepare(input_ids, positions, kv_caches, meta, logits_rows,
                                           True)
        self._run(arguments)
        single_tokens = input_ids.shape[0] == meta.seq_lens.shape[0]
        self._kept = (key, outputs, arguments) if single_tokens else None
        return outputs

    def _run(self, arguments: tuple) -> None:
        if self.library.fulcrum_decoder_stack(*arguments[0]):
            raise RuntimeError("the native decoder stack failed")

    def _prepare(self, input_ids, positions, kv_caches, meta, logits_rows, with_head: bool):
        """((normed, logits, argmax), the call's arguments with the structures and tensors
        they point into, which must live as long as the arguments are used)."""
        d = self.dims
        tokens = input_ids.shape[0]
        normed = torch.empty(tokens, d["hidden"], dtype=torch.bfloat16)
        scratch = torch.empty(tokens * self._scratch_width, dtype=torch.bfloat16)
        base = scratch.data_ptr()
        parts = [base + 2 * tokens * offset for offset in self._offsets]
        head, logits, argmax = self.head if with_head else None, None, None
        num_rows = tokens if logits_rows is None else logits_rows.shape[0]
        if head is not None and num_rows:
            logits = torch.empty(num_rows, head.out_features, dtype=torch.float32)
            if self.kernels.argmax:
                argmax = torch.empty(num_rows, dtype=torch.int64)
        k_cache = kv_caches[0][0]
        embedding = self.model.embed_tokens
        dims = _Dims(embedding.start, embedding.end,
                     _Projection() if head is None else _projection(head),
                     0 if head is None else head.out_features, d["num_layers"], d["hidden"],
                     d["num_heads"], d["num_kv_heads"], d["head_dim"], d["intermediate"],
                     k_cache.shape[3], meta.block_tables.shape[1], meta.sliding_window,
                     torch.get_num_threads(), d["eps"], d["scale"])
        rotary = self.model.rotary
        step = _Step(tokens, meta.seq_lens.shape[0], input_ids.data_ptr(),
                     embedding.weight.data_ptr(), self.model.norm.weight.data_ptr(),
                     normed.data_ptr(), *parts, *[t.data_ptr() for t in (
                         positions, rotary.cos, rotary.sin, meta.slot_mapping,
                         meta.block_tables, meta.query_start_loc, meta.seq_lens)],
                     *[None if t is None else t.data_ptr() for t in (logits, argmax,
                                                                       logits_rows)],
                     num_rows, None if self.kernel_seconds is None
                     else self.kernel_seconds.data_ptr())
        call = (ctypes.addressof(self.kernels), ctypes.addressof(self._layer_table(kv_caches)),
                ctypes.addressof(dims), ctypes.addressof(step))
        return (normed, logits, argmax), (call, dims, step, scratch, normed, logits, argmax)
