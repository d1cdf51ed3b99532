"""Programs through the real engine: a router's view reaches the policy, and on a real server a short
program arriving behind a long one finishes first under plas, not fcfs."""

from __future__ import annotations

import asyncio

import openai
import pytest

from boundless.api.launch import start_in_thread
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel
from boundless.programs.ref import ProgramRef
from boundless.programs.registry import POLICIES


async def _race(url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    done: list[str] = []

    def body(program: str) -> dict:
        return {"ignore_eos": True, "program_id": program}

    # The long program's first call gives it attained service, so its later calls start in a lower queue.
    await client.completions.create(model="tiny", prompt="long task", max_tokens=40, extra_body=body("long"))
    stream = await client.completions.create(
        model="tiny", prompt="long task, step two", max_tokens=300, stream=True, extra_body=body("long")
    )

    async def long_call() -> None:
        async for _ in stream:
            pass
        done.append("long")

    async def short_call() -> None:
        await client.completions.create(model="tiny", prompt="quick question", max_tokens=4, extra_body=body("short"))
        done.append("short")

    first_chunk = await stream.__anext__()  # the long call is running before the short one arrives
    assert first_chunk.choices
    await asyncio.gather(long_call(), short_call())
    await client.close()
    return done


@pytest.mark.parametrize(("policy", "first"), [("plas", "short"), ("atlas", "short"), ("fcfs", "long")])
def test_short_program_overtakes_a_long_one(tiny_llama: LoadedModel, policy: str, first: str) -> None:
    # One sequence slot, and queues fine enough that the long program's first call moves it down.
    config = engine_config(
        tiny_llama.name, max_model_len=512, kv_cache_gb=0.05, max_num_seqs=1, policy=policy, queue_base_s=0.01
    )
    engine = AsyncEngine(EngineCore.from_model(tiny_llama, config))
    # The order the engine ends the two racing calls (by their lengths: 300 tokens, 4), not the order the client's
    # coroutines note them: a loaded machine's client may still be reading the long call's buffered stream when the
    # short call's answer comes (a clean clone read "short" first under fcfs).
    ended: list[str] = []
    lengths = {300: "long", 4: "short"}
    engine.add_finished_listener(
        lambda d: ended.append(lengths[d.num_output_tokens]) if d.num_output_tokens in lengths else None
    )
    server = start_in_thread(engine, "tiny")
    try:
        asyncio.run(_race(server.url))
        assert ended[0] == first, ended
        if policy != "fcfs":
            assert engine.stats()["0"].num_kept >= 1  # the long call gave way and kept its KV
    finally:
        server.stop()
        engine.shutdown()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_routers_view_of_a_program_reaches_the_policy(tiny_llama: LoadedModel, policy: str) -> None:
    engine = EngineCore.from_model(
        tiny_llama, engine_config(tiny_llama.name, max_model_len=128, kv_cache_gb=0.05, policy=policy)
    )
    ref = ProgramRef("agent", "main", service_s=7.0, total_service_s=9.0, waiting_s=3.0)
    engine.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=2), program=ref)
    while engine.has_unfinished():
        engine.step()
    if policy == "fcfs":  # its table records activity only: the router's view does not change its order
        assert engine.policy.table.service("agent") == 0.0
        return
    rec = engine.policy.table.get("agent")
    # The router's figures, plus this call's own service and wait on top of its summed ones.
    assert rec.service_s >= 7.0 and rec.total_service_s >= 9.0 and rec.waiting_s >= 3.0
    assert rec.completed_calls == 1


def test_agents_sessions_name_their_programs(tiny_llama: LoadedModel) -> None:
    """An agent that knows only OpenAI's or Anthropic's API is one program to the scheduler: OpenAI's
    ``prompt_cache_key`` (Codex sends its conversation's id there), Claude Code's and Codex's session headers;
    ``program_id`` and ``X-Program-Id`` still come first."""
    engine = AsyncEngine(EngineCore.from_model(tiny_llama, engine_config(tiny_llama.name, kv_cache_gb=0.05)))
    server = start_in_thread(engine, "tiny")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        for extra in ({"prompt_cache_key": "conv-1"}, {"prompt_cache_key": "conv-1"}, {"program_id": "agent"}):
            client.completions.create(model="tiny", prompt="step", max_tokens=2, extra_body=extra)
        client.completions.create(
            model="tiny", prompt="step", max_tokens=2, extra_body={"prompt_cache_key": "conv-1", "program_id": "agent"}
        )
        client.with_options(default_headers={"X-Program-Id": "agent"}).completions.create(
            model="tiny", prompt="step", max_tokens=2, extra_body={"prompt_cache_key": "conv-1"}
        )
        # Claude Code's and Codex's session headers, below the body's own cache key.
        for header in ("X-Claude-Code-Session-Id", "session_id", "session-id"):
            client.with_options(default_headers={header: "session-9"}).completions.create(
                model="tiny", prompt="step", max_tokens=2
            )
        client.with_options(default_headers={"X-Claude-Code-Session-Id": "session-9"}).completions.create(
            model="tiny", prompt="step", max_tokens=2, extra_body={"prompt_cache_key": "conv-1"}
        )
        table = engine.core.scheduler.policy.table
        assert table.get("agent").completed_calls == 3
        assert (table.get("conv-1").completed_calls, table.get("session-9").completed_calls) == (3, 3)
    finally:
        server.stop()
        engine.shutdown()
