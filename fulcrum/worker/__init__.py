"""One rank's side of a step: its share of the weights (the loader), its KV cache, the model
runner that packs a step into tensors and runs the forward, and the sampler."""
