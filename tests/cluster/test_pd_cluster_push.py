"""DualPath's DE-read path with Ray actors: a decode engine killed while it pushes an agent's context to the prefill
engine (``--layerwise-load on``: the PE prefills as the push lands) loses no token; the PE's failed prefill places the
call again, and every output equals one engine's.

The kill must land while the PE's forward pass reads the push: after the PE took the call (the push's count came) and
before the push's last layer lands. Timed by a sleep after the push was seen on the wire, it missed now and then on a
loaded machine (the DE's push landed before the kill, or the PE was not yet running its call): no prefill failed.
So the DE is stopped (SIGSTOP) mid-push, where its push lands no further, and killed once the PE's forward pass is seen
waiting for it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from one_engine import one_engine_outputs, one_engine_texts
from served_cluster import served_cluster

from boundless.api.launch import ServerThread
from boundless.cluster.client import ClusterClient
from boundless.cluster.pd_dispatcher import PDDispatcher
from boundless.config import ClusterConfig
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

AGENTS = 6
CONTEXT_TOKENS = 400  # 25 blocks: the prefill engine holds them after each agent's first turn
# Each agent's first turn's output: its decode engine holds its KV (16 blocks) and the prefill engine does not, so
# the second turn reads on the decode engine, which pushes those blocks to the prefill engine.
FIRST_TURN_TOKENS = 256
# A layer of a push (64 KiB) crosses the link below in ~0.2 s: a PE step in flight this long waits at a gate of a push
# that lands no further, the stopped DE's.
PE_WAITS_FOR_THE_STOPPED_PUSH_S = 2.0
# The PE has taken the stopped push's call by then (its count came before the layer the DE stopped in), well before
# the push's receive times out (kv_handoff_timeout_s below); should it not have, the DE stopped between its pushes,
# with none left to land, and goes on, to be stopped in a later one.
PE_TAKES_THE_PUSH_S = 8.0


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
        # Slow links: a push of 16 blocks (128 KiB) takes ~0.4 s: the test sees it on the wire and stops its DE in it.
        storage_gbps=0.01,
        net_gbps=0.0025,
        kv_handoff_timeout_s=20.0,
    )
    with served_cluster(config, cluster) as served:
        yield served


def _pushing(client: ClusterClient, decode_engine: str) -> bool:
    """Whether the decode engine's push is on the wire: KV bytes queued on its network link (the push's count went
    ahead of them, so the PE has it, or will in a moment)."""
    import ray

    beat = ray.get(client.instances[decode_engine].actor.heartbeat.remote(), timeout=10)
    return any(link.name == "net" and link.bytes_queued.get("kv", 0) > 0 for link in beat.links)


def _step_running_s(client: ClusterClient, engine: str) -> float:
    """How long the engine's step in flight has run (0 between steps)."""
    import ray

    beat = ray.get(client.instances[engine].actor.heartbeat.remote(), timeout=10)
    return beat.step.running_s if beat.step is not None else 0.0


def _complete_all(server: ServerThread, prompts: list[list[int]], max_tokens: int, during) -> list[str]:
    async def run() -> list[str]:
        api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)

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


def test_a_decode_engine_killed_while_it_pushes_a_context_loses_no_token(
    dualpath_cluster: tuple[ClusterClient, ServerThread], tiny_llama: LoadedModel
) -> None:
    client, server = dualpath_cluster
    dispatcher = client.dispatcher
    assert isinstance(dispatcher, PDDispatcher)
    contexts = [[40 + i] + [(19 * j + 7 * i) % 300 + 3 for j in range(CONTEXT_TOKENS)] for i in range(AGENTS)]

    async def nothing() -> None:
        return None

    # Each agent's first turn: its context is prefilled (and written through to the shared store), its output decoded.
    firsts = one_engine_outputs(tiny_llama, contexts, FIRST_TURN_TOKENS)
    assert _complete_all(server, contexts, FIRST_TURN_TOKENS, nothing) == [out.text for out in firsts]
    # The next turns at once, each the context, its output and a short append: the DE that decoded the output holds
    # more of it than the PE, so it reads there and pushes the PE what the PE lacks. The DE of the first call placed
    # is killed mid-push, its call prefilling on the PE as the push lands.
    appends = [[(5 * j + i) % 300 + 9 for j in range(20)] for i in range(AGENTS)]
    turns = [c + out.token_ids + a for c, out, a in zip(contexts, firsts, appends, strict=True)]
    killed: list[str] = []

    async def kill_a_pushing_de() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with client.lock:
                prefilling = [c for c in dispatcher.calls.values() if c.read_path == "de" and c.phase == "prefilling"]
            # The first call placed: its push goes first on its DE's link.
            first = min(prefilling, key=lambda c: c.tag, default=None)
            if first is None or not _pushing(client, first.decode_engine):
                await asyncio.sleep(0.002)
                continue
            # A layer of one of its pushes is crossing its link, the push's count gone ahead of it: stopped there, the
            # DE lands no more of it, and the PE, which has the count, takes the call and waits at the layer's gate.
            info = client.instances[first.decode_engine].info
            assert info is not None
            os.kill(info.pid, signal.SIGSTOP)
            waited = time.monotonic() + PE_TAKES_THE_PUSH_S
            while time.monotonic() < waited:
                if _step_running_s(client, first.prefill_engine) > PE_WAITS_FOR_THE_STOPPED_PUSH_S:
                    os.kill(info.pid, signal.SIGKILL)  # (a stopped process dies at SIGKILL)
                    killed.append(first.decode_engine)
                    return
                await asyncio.sleep(0.05)
            os.kill(info.pid, signal.SIGCONT)

    losses, placed_again = dispatcher.num_stream_losses, dispatcher.num_failovers
    assert _complete_all(server, turns, 8, kill_a_pushing_de) == one_engine_texts(tiny_llama, turns, 8)
    assert killed, "no PE's prefill waited for a decode engine's push"
    # The kill cut a push for real: the PE's prefill reading it failed, and the call was placed again.
    assert dispatcher.num_stream_losses > losses
    assert dispatcher.num_failovers > placed_again
