"""pagedserve: a readable LLM inference and serving engine built on PagedAttention and continuous batching."""
from pagedserve.config import EngineArgs
from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "BeamSearchParams", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"
