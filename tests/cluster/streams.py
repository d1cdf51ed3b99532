"""Every prompt streamed through a served cluster at once, with a coroutine beside them (one that kills an instance
once every stream has begun, say): the client of the cluster's failure tests."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable

import openai

Beside = Callable[[asyncio.Event], Awaitable[None]]


def stream_all(
    url: str, prompts: list[list[int]], max_tokens: int, beside: Beside, timeout_s: float = 240.0
) -> list[str]:
    """Each prompt's greedy text, streamed from ``url`` at once; ``beside(started)`` runs beside them (``started`` is
    set once each stream has text)."""

    async def run() -> list[str]:
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        started = asyncio.Event()
        count = 0

        async def one(prompt: list[int]) -> str:
            nonlocal count
            stream = await api.completions.create(
                model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
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

        results = await asyncio.gather(*(one(p) for p in prompts), beside(started))
        await api.close()
        return list(results[: len(prompts)])

    return asyncio.run(asyncio.wait_for(run(), timeout=timeout_s))


def kill_once_started(pid: int) -> Beside:
    """A ``beside`` that kills process ``pid`` once every stream has begun."""

    async def kill(started: asyncio.Event) -> None:
        await started.wait()
        os.kill(pid, signal.SIGKILL)

    return kill
