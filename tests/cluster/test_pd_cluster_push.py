"""DualPath's DE-read path with Ray actors: a decode engine killed while it pushes an agent's stored context to the
prefill engine (``--layerwise-load on``: the PE prefills as the push lands) loses no token; the call is placed again
and every output equals one engine's."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from one_engine import one_engine_texts
from served_cluster import served_cluster

from boundless.api.launch import ServerThread
from boundless.cluster.client import ClusterClient
from boundless.config import ClusterConfig
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

AGENTS = 6
CONTEXT_TOKENS = 400  # 25 blocks per agent: its push takes a while over the slow links below


@pytest.fixture(scope="module")
def dualpath_cluster(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ClusterClient, ServerThread]]:
    store = tmp_path_factory.mktemp("store")
    config = engine_config(
        str(model_dirs["tiny-llama"]),
        max_model_len=1024,
        kv_cache_gb=0.02,
        kv_host_gb=0.02,
        kv_disk_path=str(store),
        kv_write_policy="through",
        layerwise_load="on",
    )
    cluster = ClusterConfig(
        prefill_instances=1,
        decode_instances=2,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=30.0,
        kv_path="dualpath",
        # Slow links: a context's read and its push take a good part of a second, so the kill lands mid-push.
        storage_gbps=0.02,
        net_gbps=0.02,
        kv_handoff_timeout_s=20.0,
    )
    with served_cluster(config, cluster) as served:
        yield served


def _complete_all(server: ServerThread, prompts: list[list[int]], max_tokens: int, during) -> list[str]:
    async def run() -> list[str]:
        api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        async def one(i: int, prompt: list[int]) -> str:
            r = await api.completions.create(
                model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True, "program_id": f"agent-{i}"},
            )  # fmt: skip
            return r.choices[0].text

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)), during())
        await api.close()
        return list(results[: len(prompts)])

    return asyncio.run(run())


def test_a_decode_engine_killed_while_it_pushes_a_stored_context_loses_no_token(
    dualpath_cluster: tuple[ClusterClient, ServerThread], tiny_llama: LoadedModel
) -> None:
    client, server = dualpath_cluster
    contexts = [[40 + i] + [(19 * j + 7 * i) % 300 + 3 for j in range(CONTEXT_TOKENS)] for i in range(AGENTS)]

    async def nothing() -> None:
        return None

    # Each agent's first turn: its context is prefilled and written through to the shared store.
    assert _complete_all(server, contexts, 4, nothing) == one_engine_texts(tiny_llama, contexts, 4)
    # The next turns at once, each the context and a short append: the PE's storage queue fills, so some calls read
    # their context on a DE and push it to the PE. The first DE seen pushing is killed mid-push.
    turns = [c + [(5 * j + i) % 300 + 9 for j in range(20)] for i, c in enumerate(contexts)]
    killed: list[str] = []

    async def kill_a_pushing_de() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with client.lock:
                pushing = [
                    c.decode_engine
                    for c in client.dispatcher.calls.values()
                    if c.read_path == "de" and c.phase == "prefilling" and c.decode_engine
                ]
            if pushing:
                info = client.instances[pushing[0]].info
                assert info is not None
                os.kill(info.pid, signal.SIGKILL)
                killed.append(pushing[0])
                return
            await asyncio.sleep(0.002)

    placed_again = client.dispatcher.num_failovers
    assert _complete_all(server, turns, 8, kill_a_pushing_de) == one_engine_texts(tiny_llama, turns, 8)
    assert killed, "no call read its context on a decode engine"
    assert client.dispatcher.num_failovers > placed_again  # its calls were placed again (pushing or decoding)
