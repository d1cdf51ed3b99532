"""Boundless: LLM serving for agent programs and long contexts."""

from boundless.compiled import install as _install_compiled

_install_compiled()  # before the modules it covers are imported (boundless/compiled.py)

from boundless.engine.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from boundless.llm import LLM, CompletionOutput, RequestOutput  # noqa: E402
from boundless.model.lora import LoRARequest  # noqa: E402
from boundless.model.pooling import PoolingParams  # noqa: E402

__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
__version__ = "0.1.0"
