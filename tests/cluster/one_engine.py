"""What one engine in this process generates greedily: the reference the cluster tests compare against."""

from __future__ import annotations

import dataclasses

from boundless import LLM, SamplingParams
from boundless.config import EngineConfig
from boundless.llm import CompletionOutput, engine_config
from boundless.model.loader import LoadedModel


def one_engine_texts(
    loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, kv_cache_dtype: str = "auto"
) -> list[str]:
    return [out.text for out in one_engine_outputs(loaded, prompts, max_tokens, kv_cache_dtype)]


def one_engine_outputs(
    loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, kv_cache_dtype: str = "auto"
) -> list[CompletionOutput]:
    """Each prompt's greedy completion by one engine (its KV held in ``kv_cache_dtype``): its text and its tokens."""
    config = engine_config(loaded.name, max_model_len=1024, kv_cache_gb=0.05, kv_cache_dtype=kv_cache_dtype)
    llm = LLM.from_config(config, loaded)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.outputs[0] for r in llm.generate(prompts, params)]


def adapter_references(
    loaded: LoadedModel, config: EngineConfig, prompts: list[list[int]], max_tokens: int
) -> tuple[list[SamplingParams], list[str]]:
    """The calls of the LoRA cluster tests: every other prompt under the adapter ``ad`` of ``config``'s
    ``--lora-modules``, the rest on the base model; each call's parameters and one engine's greedy text (checked to
    differ from the base model's where the adapter runs, so that a call that lost its adapter shows)."""
    llm = LLM.from_config(config, loaded)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    per_call = [dataclasses.replace(params, lora_name="ad" if i % 2 else None) for i in range(len(prompts))]
    expected = [r.outputs[0].text for r in llm.generate(prompts, per_call)]
    base = [r.outputs[0].text for r in llm.generate(prompts[1::2], params)]
    assert base != expected[1::2]  # the adapter changes the outputs
    return per_call, expected
