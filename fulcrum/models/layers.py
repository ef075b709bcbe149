"""The building blocks shared by every decoder-only architecture fulcrum runs.

A per-architecture file only says how its Hugging Face config maps onto `DecoderSpec`; the
transformer itself (fused QKV and gate/up projections, rotary embeddings, RMSNorm, paged
attention) is written once, here. Under tensor parallelism (a `ParallelGroup`), each rank
builds the same layers at its share's size (`Shard`); the row-parallel linears, the embedding
and the LM head then combine the ranks' parts with one collective each.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum import kernels
from fulcrum.models.native_stack import NativeStack
from fulcrum.models.sharding import Shard
from fulcrum.models.spec import DecoderSpec, linear_factor, yarn_factor
from fulcrum.models.attention import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from fulcrum.distributed.group import ParallelGroup

KVCache = Tuple[torch.Tensor, torch.Tensor]
logger = logging.getLogger(__name__)


# ------------------------------------------------------------------- normalisation
class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """RMSNorm(x); given `residual`, (RMSNorm(x + residual), x + residual), the fused
        residual add of vLLM's layers (in place on `residual` on the kernel path)."""
        if kernels.supports_elementwise(x) and self.weight.dtype == torch.bfloat16:
            out = kernels.rms_norm_bf16(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            x = residual = x + residual
        dtype = x.dtype
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * normed.to(dtype)
        return out if residual is None else (out, residual)


# ------------------------------------------------------------------------- rotary
def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent RoPE scaling (long wavelengths stretched by `factor`)."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, spec: DecoderSpec) -> Tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023), as transformers computes it: frequencies that turn fewer than
    beta_slow times over the pretrained length are divided by the factor, those turning more
    than beta_fast times kept, a linear ramp between; and the attention factor that scales
    cos and sin."""
    scaling, head_dim = spec.rope_scaling, spec.head_dim
    factor, base = yarn_factor(spec), spec.rope_theta
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(spec.original_max_positions / (rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low)
            / ((high + 0.001 if low == high else high) - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by absolute position, one
    row for each position the model serves (`spec.max_context_len`)."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        head_dim, scaling = spec.head_dim, spec.rope_scaling
        inv_freq = 1.0 / (spec.rope_theta ** (
            torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if spec.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported RoPE scaling type {spec.rope_type!r}; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        attention = 1.0
        if spec.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif spec.rope_type == "yarn":
            inv_freq, attention = _yarn_inv_freq(inv_freq, spec)
        positions = torch.arange(spec.max_context_len, dtype=torch.float32)
        if spec.rope_type == "linear":
            positions = positions / linear_factor(spec)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * attention, persistent=False)
        self.register_buffer("sin", emb.sin() * attention, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> "RopeTable":
        """This step's positions, with their cos/sin rows looked up once for every layer
        (the bf16 kernel reads the full tables instead)."""
        if dtype == torch.bfloat16 and positions.device.type == "cpu" \
                and kernels.has_elementwise():
            return RopeTable(positions, self.cos, self.sin, None, None)
        return RopeTable(positions, self.cos, self.sin,
                         self.cos[positions].unsqueeze(1).to(dtype),
                         self.sin[positions].unsqueeze(1).to(dtype))


@dataclass
class RopeTable:
    positions: torch.Tensor
    cos_table: torch.Tensor  # fp32 [max_positions, head_dim]
    sin_table: torch.Tensor
    cos: Optional[torch.Tensor]  # [tokens, 1, head_dim] in the model's dtype (torch path)
    sin: Optional[torch.Tensor]


def apply_rope(x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated (in place on the kernel path)."""
    if rope.cos is None and x.stride(1) == x.shape[2] and x.stride(2) == 1:
        return kernels.rope_bf16_(x, rope.positions, rope.cos_table, rope.sin_table)
    cos, sin = (rope.cos, rope.sin) if rope.cos is not None else (
        rope.cos_table[rope.positions].unsqueeze(1).to(x.dtype),
        rope.sin_table[rope.positions].unsqueeze(1).to(x.dtype))
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


# ------------------------------------------------------------------------ linears
class Linear(nn.Linear):
    """nn.Linear that, once its weights are final, may run through fulcrum's packed bf16
    kernel (fulcrum/kernels/linear_bf16.cpp): 2-4x torch's matmul at decode batch sizes.

    `pack()` replaces the weight by the kernel's layout, so it is held once, not twice (a
    tied LM head's packed copy sits beside the embedding table, which lookups still need).
    `pack("int8")` quantizes it first (int8 weights with a scale per output channel; each
    input row is quantized to int8 at run time with a scale of its own, and the products run
    on the kernel's int8 dot products); without the kernel the same quantized products are
    computed in fp32 (the portable path: slow, the same numbers up to fp32 rounding).

    With `reduce` (row parallel), each rank holds some input columns and the ranks' outputs
    are summed in place."""

    packed: Optional[torch.Tensor]

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 reduce: Optional["ParallelGroup"] = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.reduce = reduce
        self.register_buffer("packed", None, persistent=False)
        self.packed_bias: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None  # int8: per output channel, fp32
        self.qweight: Optional[torch.Tensor] = None  # int8 without the kernel

    def pack(self, quantization: Optional[str] = None) -> None:
        fast = kernels.supports_linear(self.weight)  # bf16 activations and weights here
        weight = self.weight.data
        if quantization == "int8":
            weight, self.scale = kernels.quantize_int8(weight)
        if fast:
            self.packed = kernels.pack_linear_weight(weight)
        elif quantization == "int8":
            self.qweight = weight
        else:
            return
        self.packed_bias = None if self.bias is None else self.bias.data.float()
        self.weight = None  # a tied LM head's embedding keeps its own reference

    def forward(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        y = self._local(x, out_dtype)
        return y if self.reduce is None else self.reduce.all_reduce(y)

    def _local(self, x: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
        if self.packed is not None:
            return kernels.linear_bf16(x, self.packed, self.packed_bias, self.out_features,
                                       out_dtype or x.dtype, self.scale)
        if self.qweight is not None:
            q, row_scale = kernels.quantize_rows_int8(x)
            y = (F.linear(q, self.qweight.float()) * row_scale * self.scale
                 + (0 if self.packed_bias is None else self.packed_bias))
            return y.to(out_dtype or x.dtype)  # fp32 products: no detour through x's dtype
        y = F.linear(x, self.weight, self.bias)
        return y if out_dtype is None else y.to(out_dtype)


class MergedLinear(Linear):
    """One matmul for several projections (q/k/v or gate/up) whose HF weights are separate."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        start = sum(self.output_sizes[:shard])
        target = getattr(self, param_name).data[start:start + self.output_sizes[shard]]
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch for shard {shard} of {param_name}: checkpoint "
                             f"{tuple(tensor.shape)}, model {tuple(target.shape)}")
        target.copy_(tensor)


# HF parameter name part -> (fused module name, shard index).
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, backend: AttentionBackend,
                 group: Optional["ParallelGroup"] = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = \
            spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = MergedLinear(spec.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                     bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_proj_bias, reduce=group)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.backend = backend
        self.scale = spec.head_dim ** -0.5

    def forward(self, rope: RopeTable, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, group: Optional["ParallelGroup"] = None) -> None:
        super().__init__()
        if spec.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported activation {spec.hidden_act!r}; supported: silu")
        self.gate_up_proj = MergedLinear(spec.hidden_size, [spec.intermediate_size] * 2,
                                         bias=False)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=False,
                                reduce=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if kernels.supports_elementwise(gate_up):
            return self.down_proj(kernels.silu_mul_bf16(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, backend: AttentionBackend,
                 group: Optional["ParallelGroup"] = None) -> None:
        super().__init__()
        self.self_attn = Attention(spec, backend, group)
        self.mlp = MLP(spec, group)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        """(output, residual stream): the residual adds are fused into the next norm."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class VocabEmbedding(nn.Module):
    """The token embedding; under tensor parallelism each rank holds a range of the
    vocabulary, looks up the ids in it, and the all-reduce fills in the others' rows."""

    def __init__(self, shard: Shard, group: Optional["ParallelGroup"]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.local_vocab, shard.full.hidden_size))
        self.start, self.end = shard.vocab_range
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden[outside] = 0
        return self.group.all_reduce(hidden)


class DecoderModel(nn.Module):
    def __init__(self, shard: Shard, backend: AttentionBackend,
                 group: Optional["ParallelGroup"] = None) -> None:
        super().__init__()
        spec = shard.local_spec
        self.rotary = RotaryEmbedding(spec)
        self.embed_tokens = VocabEmbedding(shard, group)
        self.layers = nn.ModuleList(DecoderLayer(spec, backend, group)
                                    for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.native: Optional[NativeStack] = None  # set once the weights are packed

    def forward(self, input_ids, positions, kv_caches: List[KVCache], meta: AttentionMetadata):
        if self.native is not None and self.native.fits(input_ids.shape[0]):
            return self.native(input_ids, positions, kv_caches, meta)
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.table(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        return self.norm(hidden, residual)[0]


class DecoderForCausalLM(nn.Module):
    """A decoder with its LM head; computes logits only for the rows the caller selects.

    `spec` is the whole model's shape; given a `group`, this rank builds its share of it
    (`self.spec` is then the share's shape: its heads, KV heads and MLP width)."""

    def __init__(self, spec: DecoderSpec, backend: AttentionBackend,
                 group: Optional["ParallelGroup"] = None) -> None:
        super().__init__()
        self.shard = Shard(group.rank, group.world_size, spec) if group else Shard(0, 1, spec)
        self.spec = self.shard.local_spec
        self.group = group
        self.model = DecoderModel(self.shard, backend, group)
        self.lm_head = Linear(spec.hidden_size, self.shard.local_vocab, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: List[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def forward_with_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                            kv_caches: List[KVCache], meta: AttentionMetadata,
                            logits_rows: Optional[torch.Tensor]) -> Tuple[Any, ...]:
        """A step's forward pass: (the hidden states of every row, the fp32 logits of
        `logits_rows` (None: every row), or None where no row samples, and each logits row's
        argmax where it came at no cost, else None). Where the native stack holds the LM
        head, one call, which also takes the argmax; its outputs last until the next step."""
        native = self.model.native
        if native is not None and native.head is not None:
            # Native code builds no autograd graph: no inference mode, whose entry and exit
            # around a forward pass cost ~40 us on the caches it leaves.
            return native.with_logits(input_ids, positions, kv_caches, meta, logits_rows)
        with torch.inference_mode():
            hidden = self(input_ids, positions, kv_caches, meta)
            sampling = hidden if logits_rows is None else hidden[logits_rows]
            return hidden, self.compute_logits(sampling) if sampling.shape[0] else None, None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of `hidden`'s rows; every rank of a group must call it alike."""
        logits = self.lm_head(hidden, torch.float32)
        if self.group is None:
            return logits
        return self.group.all_gather(logits)[:, :self.spec.vocab_size]

    def pack_weights(self, quantization: Optional[str] = None) -> None:
        """Give every linear layer the fastest weight layout for this device and dtype;
        `quantization="int8"` quantizes every one, the LM head too (as llama.cpp's Q8_0
        does): at batch 1 the head is a third of int8's weight bytes, read every step, and
        its per-row scales keep each token's logits close (benchmarks/int8_quality.py
        measures the KL divergence from bf16). Packed weights then move, in the order a step
        reads them, onto huge pages."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for module in linears:
            module.pack(quantization)
        if any(m.qweight is not None for m in linears):
            _warn_int8_portable(self.model.norm.weight)
        packed = [m for m in linears if m.packed is not None]
        slots = kernels.huge_page_tensors([(m.packed.shape, m.packed.dtype) for m in packed])
        for module, slot in zip(packed, slots):  # each old copy is freed as its slot fills
            module.packed = slot.copy_(module.packed)
        self.model.native = NativeStack.for_model(
            self.model, self.model.layers[0].self_attn.backend, self.group, self.lm_head)

    def load_weights(self, weights) -> None:
        """Copy (name, tensor) pairs in Hugging Face naming into the fused parameters (this
        rank's slice of each: a tensor may be a lazy safetensors slice). Every part of a
        fused parameter must come: one left out would keep its random initial values."""
        params = dict(self.named_parameters())
        loaded = set()
        untied_head = None
        for name, tensor in weights:
            if any(f"rotary_emb.{buffer}" in name for buffer in ROTARY_BUFFERS):
                continue
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                untied_head = self.shard.slice(name, tensor)  # read now: its file closes
                continue
            target, shard = _fused_target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            tensor = self.shard.slice(name, tensor)
            if not tensor.is_floating_point():
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}: fulcrum reads "
                                 f"floating-point checkpoints (not pre-quantized ones; "
                                 f"quantization='int8' quantizes at load)")
            if shard is None:
                _copy_checked(params[target], tensor, name)
            else:
                module = self.get_submodule(target.rsplit(".", 1)[0])
                module.load_shard(target.rsplit(".", 1)[1], shard, tensor)
            loaded.add((target, shard))
        missing = sorted(_hf_name(target, shard) for target, shard in self._expected_parts()
                         if (target, shard) not in loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")
        if untied_head is not None:
            self._warn_if_head_differs(untied_head)

    def _expected_parts(self) -> List[Tuple[str, Optional[int]]]:
        """(parameter, part) for every tensor a checkpoint must hold: each part of a fused
        parameter, None for the others; a tied LM head is the embeddings'."""
        parts = []
        for name, _ in self.named_parameters():
            module = self.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(module, MergedLinear):
                parts += [(name, shard) for shard in range(len(module.output_sizes))]
            elif not (name == "lm_head.weight" and self.spec.tie_word_embeddings):
                parts.append((name, None))
        return parts

    def _warn_if_head_differs(self, head) -> None:
        """The config ties the LM head to the embeddings, yet the checkpoint holds a head of
        its own: it is left out, as vLLM does (transformers 5 unties them when they
        differ), so say so where they differ."""
        embeddings = self.model.embed_tokens.weight
        if head.shape != embeddings.shape or not torch.equal(
                head.to(device=embeddings.device, dtype=embeddings.dtype), embeddings):
            logger.warning("the checkpoint's lm_head.weight differs from its embeddings, but "
                           "config.json ties them (tie_word_embeddings): the embeddings serve "
                           "as the LM head, as in vLLM (transformers 5 would use the stored "
                           "head); set tie_word_embeddings to false to use it")


def _warn_int8_portable(like: torch.Tensor) -> None:
    """int8 layers the kernel cannot take (`like`: a weight of the model's dtype and device)
    widen their int8 weights to fp32 at every call: the decode steps of a float32 Llama of 16M
    parameters took 2x to 6x as long as without int8 (float16: 2x), which is asked for to be
    faster. Say so at load, and why."""
    if like.device.type != "cpu" or like.dtype != torch.bfloat16:
        why = (f"the model runs in {str(like.dtype).removeprefix('torch.')} on "
               f"{like.device.type}; the int8 kernel takes bfloat16 on CPUs (dtype='bfloat16')")
    elif not kernels.supports_linear(like.new_empty(0, 2)):
        why = ("no int8 kernel runs here (it needs AVX2 and FMA or AVX512-VNNI, a C++ compiler "
               "and FULCRUM_DISABLE_KERNELS unset)")
    else:
        why = "some layers have an odd input width, which the int8 kernel does not take"
    logger.warning("quantization='int8' runs on the portable path: %s. Its layers widen their "
                   "int8 weights to fp32 at every call, so steps may take several times as "
                   "long as without quantization", why)


# Non-persistent RoPE tables some checkpoints carry (vLLM skips the same names).
ROTARY_BUFFERS = ("inv_freq", "cos_cached", "sin_cached")


def _hf_name(target: str, shard: Optional[int]) -> str:
    """The checkpoint's name of part `shard` of the fused parameter `target`."""
    for part, (fused, index) in STACKED_PARAMS.items():
        if index == shard and f".{fused}." in target:
            return target.replace(f".{fused}.", f".{part}.")
    return target


def _fused_target(name: str) -> Tuple[str, Optional[int]]:
    for part, (fused, shard) in STACKED_PARAMS.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                         f"model {tuple(param.shape)}")
    param.data.copy_(tensor)
