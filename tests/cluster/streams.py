"""Every prompt streamed through a served cluster at once, with a coroutine beside them (one that kills an instance
while it streams, say): the client of the cluster's failure tests."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable

import httpx
import openai

from boundless.cluster.client import ClusterClient
from boundless.cluster.pd_dispatcher import PDDispatcher

Beside = Callable[[], Awaitable[None]]


def stream_all(
    url: str,
    prompts: list[list[int]],
    max_tokens: int,
    beside: Beside,
    timeout_s: float = 240.0,
    models: list[str] | None = None,
) -> list[str]:
    """Each prompt's greedy text, streamed from ``url`` at once; ``beside()`` runs beside them. ``models``: each
    prompt's served model (default: ``tiny``)."""

    async def run() -> list[str]:
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

        async def one(prompt: list[int], model: str) -> str:
            stream = await api.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return "".join([chunk.choices[0].text if chunk.choices else "" async for chunk in stream])

        names = models or ["tiny"] * len(prompts)
        results = await asyncio.gather(*(one(p, m) for p, m in zip(prompts, names, strict=True)), beside())
        await api.close()
        return list(results[: len(prompts)])

    return asyncio.run(asyncio.wait_for(run(), timeout=timeout_s))


def kill_mid_stream(client: ClusterClient, instance_id: str, max_tokens: int) -> Beside:
    """A ``beside`` that kills instance ``instance_id`` once a call it serves has streamed tokens and has most of its
    ``max_tokens`` left, as the front end's dispatcher sees it.

    The streams' first chunks as the test's client reads them are no such sign: on a loaded machine a fast
    instance can finish all its calls before the client has read the start of every stream, and a kill then
    finds nothing in flight to fail over."""
    info = client.instances[instance_id].info
    assert info is not None

    def streaming_there() -> bool:
        with client.lock:
            dispatcher = client.dispatcher
            calls = dispatcher.calls if isinstance(dispatcher, PDDispatcher) else dispatcher.inflight
            return any(
                c.instance == instance_id and 3 <= len(c.output_token_ids) <= max_tokens // 2 for c in calls.values()
            )

    async def kill() -> None:
        while not streaming_there():
            await asyncio.sleep(0.002)
        os.kill(info.pid, signal.SIGKILL)

    return kill


def complete_all(
    url: str, prompts: list[list[int]], max_tokens: int, timeout_s: float = 120.0
) -> list[tuple[str, str]]:
    """Each prompt's greedy text (not streamed), all sent at once, with the fingerprint of the instance serving it."""

    async def run() -> list[tuple[str, str]]:
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

        async def one(prompt: list[int]) -> tuple[str, str]:
            r = await api.completions.create(
                model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.choices[0].text, r.system_fingerprint or ""

        results = await asyncio.gather(*(one(p) for p in prompts))
        await api.close()
        return list(results)

    return asyncio.run(asyncio.wait_for(run(), timeout=timeout_s))


def wait_for_state(url: str, instance_id: str, state: str, timeout_s: float = 180.0) -> dict:
    """The instance's entry in ``/cluster`` once it shows ``state`` (or as it is when ``timeout_s`` runs out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        entry = next(i for i in httpx.get(url + "/cluster").json()["instances"] if i["id"] == instance_id)
        if entry["state"] == state or time.monotonic() >= deadline:
            return entry
        time.sleep(0.2)
