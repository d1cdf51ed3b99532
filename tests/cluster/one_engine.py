"""What one engine in this process generates greedily: the reference the cluster tests compare against."""

from __future__ import annotations

from boundless import LLM, SamplingParams
from boundless.llm import CompletionOutput, engine_config
from boundless.model.loader import LoadedModel


def one_engine_texts(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int) -> list[str]:
    return [out.text for out in one_engine_outputs(loaded, prompts, max_tokens)]


def one_engine_outputs(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int) -> list[CompletionOutput]:
    """Each prompt's greedy completion by one engine: its text and its tokens."""
    llm = LLM.from_config(engine_config(loaded.name, max_model_len=1024, kv_cache_gb=0.05), loaded)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.outputs[0] for r in llm.generate(prompts, params)]
