"""Boundless: LLM serving for agent programs and long contexts."""

from boundless.engine.sampling_params import RequestOutputKind, SamplingParams
from boundless.llm import LLM, CompletionOutput, RequestOutput
from boundless.model.lora import LoRARequest

__all__ = ["LLM", "CompletionOutput", "LoRARequest", "RequestOutput", "RequestOutputKind", "SamplingParams"]
__version__ = "0.1.0"
