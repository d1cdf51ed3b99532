"""Boundless: LLM serving for agent programs and long contexts."""

from boundless.engine.sampling_params import SamplingParams
from boundless.llm import LLM, CompletionOutput, RequestOutput
from boundless.model.lora import LoRARequest

__all__ = ["LLM", "CompletionOutput", "LoRARequest", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
