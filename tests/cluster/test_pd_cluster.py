"""Prefill and decode engines as Ray actors behind a real server, with a tiny random model: greedy outputs
equal one engine's, ``/cluster`` lists the roles, ``/metrics`` the KV paths and read queues, and an engine of
either role killed while calls stream loses no token."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from one_engine import one_engine_texts
from served_cluster import served_cluster
from streams import kill_mid_stream, stream_all

from boundless.api.launch import ServerThread
from boundless.cluster.client import ClusterClient
from boundless.cluster.pd_dispatcher import DropPrefetch, Prefetch
from boundless.config import ClusterConfig
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def pd_cluster(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ClusterClient, ServerThread]]:
    store = tmp_path_factory.mktemp("store")
    config = engine_config(
        str(model_dirs["tiny-llama"]), max_model_len=1024, kv_cache_gb=0.02, kv_host_gb=0.02, kv_disk_path=str(store)
    )
    cluster = ClusterConfig(
        prefill_instances=2,
        decode_instances=2,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=30.0,
        max_restarts=0,  # the engines killed here stay lost (tests/cluster/test_local_pd_restart.py restarts one)
        storage_gbps=8.0,
        net_gbps=8.0,
        kv_handoff_timeout_s=20.0,
    )
    with served_cluster(config, cluster) as served:
        yield served


def test_calls_are_prefilled_handed_off_and_decoded_with_one_engines_tokens(
    pd_cluster: tuple[ClusterClient, ServerThread], tiny_llama: LoadedModel
) -> None:
    client, server = pd_cluster
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    # An agent's turns: each prompt extends the last one (its context and output) with new input.
    context = [(13 * j) % 300 + 3 for j in range(60)]
    prompts, texts = [], []
    for turn in range(3):
        r = api.completions.create(
            model="tiny",
            prompt=context,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True, "program_id": "agent", "return_token_ids": True},
        )
        prompts.append(list(context))
        texts.append(r.choices[0].text)
        assert r.system_fingerprint.startswith("boundless-d")  # the last tokens came from a decode engine
        context += r.choices[0].model_extra["token_ids"] + [(7 * turn + j) % 300 + 5 for j in range(30)]
    assert texts == one_engine_texts(tiny_llama, prompts, 12)
    assert sum(client.dispatcher.placements.values()) == 3  # every call went through a PE and a DE
    view = httpx.get(server.url + "/cluster").json()["instances"]
    assert {i["id"]: i["role"] for i in view} == {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
    time.sleep(0.6)  # a heartbeat or two: the engines' counters reach the router
    metrics = httpx.get(server.url + "/metrics").text
    handoff = [line for line in metrics.splitlines() if 'path="handoff"' in line and line.startswith("boundless_pd")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in handoff) > 0, handoff
    assert 'boundless_pd_read_queue_bytes{instance="d0",role="decode"}' in metrics
    assert 'boundless_link_bytes_total{instance="p0",link="net",traffic="kv"}' in metrics
    assert "boundless_pd_calls_total" in metrics
    assert "boundless_pd_prefetches" in metrics
    # The dispatcher's reads ahead reach the actors (not waited for): a PE reads the agent's stored context ahead for
    # a call that then never comes, and lets it go; both actors keep serving.
    with client.lock:
        assert client._carry_out([Prefetch("p1", "ahead", prompts[-1]), DropPrefetch("p1", "ahead")]) is None
    import ray

    ahead = ray.get(client.instances["p0"].actor.prefetch.remote("ahead-2", prompts[-1]), timeout=30)
    assert ahead is not None and ahead >= 0
    ray.get(client.instances["p0"].actor.drop_prefetch.remote("ahead-2"), timeout=30)
    assert all(i["state"] == "alive" for i in httpx.get(server.url + "/cluster").json()["instances"])


def _wait_dead(client: ClusterClient, iid: str) -> None:
    deadline = time.monotonic() + 10
    while client.dispatcher.views[iid].alive and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not client.dispatcher.views[iid].alive


def test_more_samples_than_the_engines_queues_hold_is_a_400_and_the_rest_is_served(
    pd_cluster: tuple[ClusterClient, ServerThread],
) -> None:
    """The engines' queues hold 4 x 1,024 requests (--max-waiting each): 100 prompts x 128 samples could never wait,
    so a 400 naming n, as one engine answers. Before, prefill and decode engines' front end had no bound: the samples
    were queued call by call (each placement walking the queue) and the server answered nothing else for minutes."""
    client, server = pd_cluster
    assert client.max_waiting == 4096 and client.dispatcher.max_queued == 4096  # type: ignore[attr-defined]
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model="tiny", prompt=["hi"] * 100, n=128, max_tokens=1)
    assert err.value.body["param"] == "n"  # type: ignore[index]
    served = api.completions.create(model="tiny", prompt=[[5, 6, 7]] * 2, n=2, max_tokens=2, temperature=0)
    assert len(served.choices) == 4


def test_a_decode_engine_killed_mid_stream_and_a_prefill_engine_killed_mid_prefill_lose_no_token(
    pd_cluster: tuple[ClusterClient, ServerThread], tiny_llama: LoadedModel
) -> None:
    client, server = pd_cluster
    prompts = [[30 + i] + [(11 * j + i) % 300 + 3 for j in range(40)] for i in range(8)]
    max_tokens = 200
    failovers = client.dispatcher.num_failovers  # the DE killed while it streams a call
    texts = stream_all(server.url, prompts, max_tokens, kill_mid_stream(client, "d1", max_tokens))
    assert texts == one_engine_texts(tiny_llama, prompts, max_tokens)
    assert client.dispatcher.num_failovers > failovers  # the dead DE had calls decoding
    _wait_dead(client, "d1")
    # Now a prefill engine, while long prompts are being prefilled: those calls start over on the other.
    pe = client.instances["p1"].info
    assert pe is not None
    long_prompts = [[60 + i] + [(17 * j + i) % 300 + 3 for j in range(900)] for i in range(8)]

    async def kill_pe() -> None:
        def prefilling_on_p1() -> bool:
            with client.lock:
                return any(
                    c.phase == "prefilling" and c.prefill_engine == "p1" for c in client.dispatcher.calls.values()
                )

        while not prefilling_on_p1():
            await asyncio.sleep(0.001)
        os.kill(pe.pid, signal.SIGKILL)

    failovers = client.dispatcher.num_failovers
    assert stream_all(server.url, long_prompts, 20, kill_pe) == one_engine_texts(tiny_llama, long_prompts, 20)
    _wait_dead(client, "p1")
    assert client.dispatcher.num_failovers > failovers  # calls it was prefilling started over on the other
    states = {i["id"]: i["state"] for i in httpx.get(server.url + "/cluster").json()["instances"]}
    assert states == {"p0": "alive", "p1": "dead", "d0": "alive", "d1": "dead"}
