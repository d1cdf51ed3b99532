"""The usage of a call prefilled and decoded on two engines (``cluster/local_pd.py``): its last delta, from which the
server writes ``usage.prompt_tokens_details.cached_tokens``, counts the prompt's tokens a cache served, as one
engine's does. The decode engine finds every block the prefill engine handed it, which no cache served the client's
prompt: a fresh prompt was reported nearly all cached (144 of 150 tokens on a served cluster)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from boundless.cluster.local_pd import LocalPDCluster
from boundless.config import ClusterConfig
from boundless.engine.core import RequestDelta
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

PROMPT = [(23 * j) % 300 + 3 for j in range(70)]  # four full blocks and a partial one


def test_cached_tokens_count_what_a_cache_served_not_the_handoff(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel
) -> None:
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=1024, kv_cache_gb=0.02)
    pd = LocalPDCluster(config, ClusterConfig(prefill_instances=1, decode_instances=1), tiny_llama)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def call(rid: str) -> list[RequestDelta]:
        return [delta async for delta in pd.submit(rid, PROMPT, params)]

    try:
        for rid, cached in (("fresh", 0), ("again", 64)):  # again: its four full blocks, in the PE's cache now
            deltas = asyncio.run(asyncio.wait_for(call(rid), timeout=60))
            last = deltas[-1]
            assert last.finished and last.finish_reason == "length"
            assert {d.instance for d in deltas} == {"p0", "d0"}  # its first token on the PE, the rest on the DE
            assert last.num_cached_tokens == cached
    finally:
        pd.shutdown()
