"""Prefill and decode engines as Ray actors: a decode engine killed mid-stream is restarted as a fresh actor with its
old rank (its KV transport listens at the same address, and the prefill engine connects to it again), and decodes
later calls with one engine's greedy tokens."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest
from one_engine import one_engine_texts
from served_cluster import served_cluster
from streams import kill_once_started, stream_all

from boundless.config import ClusterConfig
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
VICTIM = "d1"


def test_a_killed_decode_engine_is_restarted_and_decodes_again(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel, tmp_path: Path
) -> None:
    config = engine_config(
        str(model_dirs["tiny-llama"]),
        max_model_len=1024,
        kv_cache_gb=0.02,
        kv_host_gb=0.02,
        kv_disk_path=str(tmp_path / "store"),
    )
    cluster = ClusterConfig(
        prefill_instances=1,
        decode_instances=2,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=30.0,
        kv_handoff_timeout_s=20.0,
        restart_delay_s=1.0,
    )
    with served_cluster(config, cluster) as (client, server):
        victim = client.instances[VICTIM].info
        assert victim is not None
        prompts = [[30 + i] + [(11 * j + i) % 300 + 3 for j in range(40)] for i in range(6)]
        max_tokens = 120

        texts = stream_all(server.url, prompts, max_tokens, kill_once_started(victim.pid))  # once every call decodes
        assert texts == one_engine_texts(tiny_llama, prompts, max_tokens)
        deadline = time.monotonic() + 180
        entry: dict = {}
        while time.monotonic() < deadline:
            entry = next(i for i in httpx.get(server.url + "/cluster").json()["instances"] if i["id"] == VICTIM)
            if entry["state"] == "alive":
                break
            time.sleep(0.2)
        assert entry["state"] == "alive" and entry["pid"] != victim.pid and entry["restarts"] == 1
        later_prompts = [[70 + i] + [(17 * j + i) % 300 + 3 for j in range(40)] for i in range(6)]

        async def later() -> list[tuple[str, str]]:
            api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

            async def one(prompt: list[int]) -> tuple[str, str]:
                r = await api.completions.create(
                    model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
                )
                return r.choices[0].text, r.system_fingerprint or ""

            results = await asyncio.gather(*(one(p) for p in later_prompts))
            await api.close()
            return list(results)

        served = asyncio.run(asyncio.wait_for(later(), timeout=120))
        assert [t for t, _ in served] == one_engine_texts(tiny_llama, later_prompts, 16)
        assert f"boundless-{VICTIM}" in {f for _, f in served}  # decoded on the restarted engine
