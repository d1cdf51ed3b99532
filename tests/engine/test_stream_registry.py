"""The registry that carries deltas from the engine thread to each request's coroutine."""

from __future__ import annotations

import asyncio

import pytest

from boundless.engine.async_engine import StreamRegistry
from boundless.engine.core import RequestDelta


def _delta(request_id: str, finished: bool) -> RequestDelta:
    return RequestDelta(request_id, [7], "x", [], finished=finished, finish_reason="length" if finished else None)


def test_a_started_request_streams_its_deltas_until_finished() -> None:
    async def run() -> list[bool]:
        registry = StreamRegistry()
        stream = registry.open_and_start("r", lambda rid: None, lambda: None)
        assert "r" in registry
        registry.deliver(_delta("r", finished=False))
        registry.deliver(_delta("r", finished=True))
        registry.deliver(_delta("r", finished=False))  # after the end: dropped
        return [d.finished async for d in stream]

    assert asyncio.run(run()) == [False, True]


def test_a_request_that_fails_to_start_leaves_no_stream() -> None:
    async def run() -> None:
        registry = StreamRegistry()

        def start() -> None:
            raise ValueError("queue full")

        with pytest.raises(ValueError, match="queue full"):
            registry.open_and_start("r", lambda rid: None, start)
        assert "r" not in registry

    asyncio.run(run())
