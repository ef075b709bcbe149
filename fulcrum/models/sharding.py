"""Which part of a model one tensor-parallel rank holds, and its slice of each checkpoint tensor.

Megatron's split, as vLLM makes it: q/k/v and gate/up are cut by output rows (column
parallel: each rank computes whole heads and a share of the MLP's width); o and down by
input columns (row parallel: each rank's partial sums are added by an all-reduce); the
embedding and the LM head by vocabulary rows. With fewer KV heads than ranks, each KV head is
held by the ranks whose query heads read it. A row-parallel bias is held by rank 0 alone, so
that the all-reduce adds it once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Tuple

import torch

from fulcrum.models.spec import DecoderSpec

# HF name part -> how the rank slices that tensor: by query heads, KV heads, MLP width
# (rows of the output, or columns of the input for row-parallel layers).
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW = {"o_proj": "q", "down_proj": "mlp"}
_VOCAB = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    full: DecoderSpec  # the whole model's shape

    def __post_init__(self) -> None:
        spec, size = self.full, self.size
        if spec.num_heads % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the model's "
                             f"{spec.num_heads} attention heads")
        if spec.num_kv_heads % size and size % spec.num_kv_heads:
            raise ValueError(f"tensor_parallel_size={size} and the model's {spec.num_kv_heads} "
                             "KV heads must divide one another")
        if spec.intermediate_size % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the model's MLP width "
                             f"({spec.intermediate_size})")

    @property
    def local_spec(self) -> DecoderSpec:
        """The shape of this rank's part (the vocabulary stays whole: see vocab_range)."""
        return dataclasses.replace(
            self.full, num_heads=self.full.num_heads // self.size,
            num_kv_heads=max(1, self.full.num_kv_heads // self.size),
            intermediate_size=self.full.intermediate_size // self.size)

    @property
    def local_vocab(self) -> int:
        """Rows of this rank's embedding and LM head (the last rank's padded with zeros)."""
        return -(-self.full.vocab_size // self.size)

    @property
    def vocab_range(self) -> Tuple[int, int]:
        start = self.rank * self.local_vocab
        return start, min(start + self.local_vocab, self.full.vocab_size)

    def _range(self, kind: str) -> Tuple[int, int]:
        """[start, end) of this rank's rows of a q, kv or mlp output."""
        spec, local = self.full, self.local_spec
        if kind == "q":
            width = local.num_heads * spec.head_dim
            return self.rank * width, (self.rank + 1) * width
        if kind == "kv":
            head = self.rank * spec.num_kv_heads // self.size  # KV heads replicate when fewer
            return head * spec.head_dim, (head + local.num_kv_heads) * spec.head_dim
        width = local.intermediate_size
        return self.rank * width, (self.rank + 1) * width

    def slice(self, name: str, tensor: Any) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (HF naming). `tensor` is a tensor or
        a lazy safetensors slice, so a rank reads only its own part from the file."""
        parts = name.split(".")
        if self.size == 1:
            return tensor[:]
        for part, kind in _COLUMN.items():
            if part in parts:
                start, end = self._range(kind)
                return tensor[start:end]
        for part, kind in _ROW.items():
            if part in parts:
                if parts[-1] == "bias":
                    full = tensor[:]
                    return full if self.rank == 0 else torch.zeros_like(full)
                start, end = self._range(kind)
                return tensor[:, start:end]
        if any(part in parts for part in _VOCAB):
            start, end = self.vocab_range
            rows = tensor[start:end]
            missing = self.local_vocab - rows.shape[0]
            return torch.cat([rows, rows.new_zeros(missing, *rows.shape[1:])]) if missing else rows
        return tensor[:]
