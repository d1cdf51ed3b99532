"""A 2-instance Ray cluster behind a real server, one of whose actors is killed mid-stream: its calls finish on the
other with one engine's greedy tokens, a fresh actor is started in its place once the restart is due, and later
calls are routed to it again; ``/cluster`` and ``/metrics`` report the restart."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest
from one_engine import one_engine_texts
from streams import kill_once_started, stream_all

from boundless.api.launch import start_in_thread
from boundless.cluster.client import ClusterClient
from boundless.config import ClusterConfig
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
VICTIM = "1"


def test_a_killed_instance_is_restarted_and_takes_calls_again(
    model_dirs: dict[str, Path], tiny_llama: LoadedModel
) -> None:
    import ray

    if ray.is_initialized():  # a Ray of another module's test hooks
        ray.shutdown()
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=1024, kv_cache_gb=0.05)
    cluster = ClusterConfig(
        instances=2, heartbeat_interval_s=0.2, heartbeat_timeout_s=30.0, restart_delay_s=1.0, max_restarts=2
    )
    client = ClusterClient(config, cluster)
    server = start_in_thread(client, "tiny")
    prompts = [[30 + i, 31, 32, 33, 34] for i in range(8)]
    max_tokens = 200
    try:
        victim = client.instances[VICTIM].info
        assert victim is not None

        # Every call finishes once, with its tokens: those on the killed instance resumed on the other.
        texts = stream_all(server.url, prompts, max_tokens, kill_once_started(victim.pid))
        assert client.dispatcher.num_failovers > 0
        assert texts == one_engine_texts(tiny_llama, prompts, max_tokens)
        # The restart: a new actor (another process) in its place, alive from its first heartbeat.
        deadline = time.monotonic() + 180
        entry: dict = {}
        while time.monotonic() < deadline:
            entry = next(i for i in httpx.get(server.url + "/cluster").json()["instances"] if i["id"] == VICTIM)
            if entry["state"] == "alive":
                break
            time.sleep(0.2)
        assert entry["state"] == "alive" and entry["pid"] != victim.pid  # without restarts: dead for good
        assert (entry["lost"], entry["restarts"], entry["failed_restarts"]) == (1, 1, 0)
        metrics = httpx.get(server.url + "/metrics").text
        assert f'boundless_instance_restarts_total{{instance="{VICTIM}"}} 1.0' in metrics
        # Later calls go to both instances again, with one engine's tokens.
        later_prompts = [[60 + i, 61, 62] for i in range(8)]

        async def later() -> list[tuple[str, str]]:
            api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

            async def one(prompt: list[int]) -> tuple[str, str]:
                r = await api.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
                return r.choices[0].text, r.system_fingerprint or ""

            results = await asyncio.gather(*(one(p) for p in later_prompts))
            await api.close()
            return list(results)

        served = asyncio.run(asyncio.wait_for(later(), timeout=120))
        assert [t for t, _ in served] == one_engine_texts(tiny_llama, later_prompts, 16)
        assert f"boundless-{VICTIM}" in {f for _, f in served}
    finally:
        server.stop()
        client.shutdown()
        ray.shutdown()
