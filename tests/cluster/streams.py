"""Every prompt streamed through a served cluster at once, with a coroutine beside them (one that kills an instance
once every stream has begun, say): the client of the cluster's failure tests."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable

import httpx
import openai

Beside = Callable[[asyncio.Event], Awaitable[None]]


def stream_all(
    url: str,
    prompts: list[list[int]],
    max_tokens: int,
    beside: Beside,
    timeout_s: float = 240.0,
    models: list[str] | None = None,
) -> list[str]:
    """Each prompt's greedy text, streamed from ``url`` at once; ``beside(started)`` runs beside them (``started`` is
    set once each stream has text). ``models``: each prompt's served model (default: ``tiny``)."""

    async def run() -> list[str]:
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        started = asyncio.Event()
        count = 0

        async def one(prompt: list[int], model: str) -> str:
            nonlocal count
            stream = await api.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            parts = []
            async for chunk in stream:
                parts.append(chunk.choices[0].text if chunk.choices else "")
                if len(parts) == 3:
                    count += 1
                    if count == len(prompts):
                        started.set()
            return "".join(parts)

        names = models or ["tiny"] * len(prompts)
        results = await asyncio.gather(*(one(p, m) for p, m in zip(prompts, names, strict=True)), beside(started))
        await api.close()
        return list(results[: len(prompts)])

    return asyncio.run(asyncio.wait_for(run(), timeout=timeout_s))


def kill_once_started(pid: int) -> Beside:
    """A ``beside`` that kills process ``pid`` once every stream has begun."""

    async def kill(started: asyncio.Event) -> None:
        await started.wait()
        os.kill(pid, signal.SIGKILL)

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
