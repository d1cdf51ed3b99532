"""Boundless: LLM serving for agent programs and long contexts."""

from boundless.engine.sampling_params import SamplingParams
from boundless.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
