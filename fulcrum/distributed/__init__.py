"""The ranks of a tensor-parallel model: their process group and how they are launched."""
