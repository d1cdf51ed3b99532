"""A 2-instance Ray cluster behind a real server, one of whose engines hangs inside a forward pass (the instances'
test hook): its actor still answers ``drain`` and ``heartbeat``, yet the step watchdog finds it, the actor is
killed, and every call streaming on it completes on the other with one engine's greedy tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from one_engine import one_engine_texts
from served_cluster import ray_with_env

from boundless.api.launch import start_in_thread
from boundless.cluster.client import ClusterClient
from boundless.cluster.instance import HANG_STEP_ENV
from boundless.config import ClusterConfig
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
STUCK = "1"


@pytest.fixture(scope="module")
def ray_with_a_hanging_instance() -> Iterator[None]:
    with ray_with_env(HANG_STEP_ENV, STUCK):
        yield


def test_an_instance_stuck_in_a_step_is_killed_and_its_calls_finish_on_the_other(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel, ray_with_a_hanging_instance: None
) -> None:
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=1024, kv_cache_gb=0.05)
    # A tiny model's step takes milliseconds: 3 s in one is stuck. The heartbeat timeout stays generous (a loaded
    # machine), and is not what finds this instance: it answers every heartbeat.
    cluster = ClusterConfig(
        instances=2, heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0, step_timeout_s=3.0, max_restarts=0
    )
    client = ClusterClient(config, cluster)
    server = start_in_thread(client, "tiny")
    prompts = [[40 + i, 41, 42, 43, 44] for i in range(8)]
    max_tokens = 40
    try:

        async def run() -> list[tuple[str, str]]:
            api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

            async def one(prompt: list[int]) -> tuple[str, str]:
                stream = await api.completions.create(
                    model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                parts, fingerprints = [], []
                async for chunk in stream:
                    parts.append(chunk.choices[0].text if chunk.choices else "")
                    fingerprints.append(chunk.system_fingerprint)
                return "".join(parts), fingerprints[0]

            results = await asyncio.gather(*(one(p) for p in prompts))
            await api.close()
            return list(results)

        # Without the watchdog the calls on the stuck instance wait for ever.
        results = asyncio.run(asyncio.wait_for(run(), timeout=240))
        assert [text for text, _ in results] == one_engine_texts(tiny_llama, prompts, max_tokens)
        assert f"boundless-{STUCK}" in {first for _, first in results}  # some calls began on the stuck instance
        assert not client.dispatcher.views[STUCK].alive
        assert client.dispatcher.num_failovers > 0
        deadline = time.monotonic() + 30
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = {i["id"]: i["state"] for i in httpx.get(server.url + "/cluster").json()["instances"]}
            if states == {"0": "alive", STUCK: "dead"}:
                break
            time.sleep(0.2)
        assert states == {"0": "alive", STUCK: "dead"}
    finally:
        server.stop()
        client.shutdown()
