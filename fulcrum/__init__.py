"""fulcrum: an LLM inference engine that balances prefill against decode.

Continuous batching over a paged KV cache with chunked prefill under a per-step token budget,
behind vLLM's offline API (`LLM`, `SamplingParams`) and an OpenAI-compatible server.
"""

from fulcrum.config import EngineConfig
from fulcrum.engine import LLMEngine
from fulcrum.llm import LLM
from fulcrum.outputs import CompletionOutput, RequestOutput
from fulcrum.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "__version__"]
