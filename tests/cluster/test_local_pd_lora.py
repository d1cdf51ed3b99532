"""LoRA adapters with prefill and decode engines in this process (``cluster/local_pd.py``): a call prefilled on one
engine and decoded on another runs with its adapter on both (the handed-off KV is the adapter's), with one engine's
greedy tokens; calls of the base model beside them keep theirs."""

from __future__ import annotations

import asyncio
from pathlib import Path

from one_engine import adapter_references

from boundless.cluster.local_pd import LocalPDCluster
from boundless.config import ClusterConfig
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel
from boundless.model.random_model import write_random_lora

MAX_TOKENS = 16


def test_adapter_calls_prefilled_and_decoded_on_two_engines(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel, tmp_path: Path
) -> None:
    adapter = write_random_lora(tmp_path / "ad", tiny_llama.arch, rank=8, std=0.3)
    config = engine_config(
        str(model_dirs["tiny-llama"]),
        max_model_len=1024,
        kv_cache_gb=0.02,
        enable_lora=True,
        max_loras=2,
        lora_modules=(f"ad={adapter}",),
    )
    prompts = [[40 + i] + [(17 * j + i) % 300 + 3 for j in range(36)] for i in range(6)]
    per_call, expected = adapter_references(tiny_llama, config, prompts, MAX_TOKENS)

    pd = LocalPDCluster(config, ClusterConfig(prefill_instances=1, decode_instances=1), tiny_llama)

    async def call(rid: str, prompt: list[int], p: SamplingParams) -> tuple[str, set[str]]:
        text, instances = "", set()
        async for delta in pd.submit(rid, prompt, p):
            assert delta.finish_reason != "error", delta.stop_reason
            text += delta.new_text
            instances.add(delta.instance)
        return text, instances

    async def run() -> list[tuple[str, set[str]]]:
        calls = (call(f"c{i}", p, per_call[i]) for i, p in enumerate(prompts))
        return list(await asyncio.gather(*calls))

    try:
        results = asyncio.run(asyncio.wait_for(run(), timeout=180))
        assert [text for text, _ in results] == expected
        assert all(len(instances) == 2 for _, instances in results)  # first token on the PE, the rest on the DE
    finally:
        pd.shutdown()
