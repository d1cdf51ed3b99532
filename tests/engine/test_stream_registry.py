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


def test_a_steps_deltas_reach_their_streams_in_one_hand_off_and_are_read_together() -> None:
    async def run() -> tuple[list[list[tuple[str, bool]]], list[tuple[str, bool]]]:
        registry = StreamRegistry()
        a = registry.open_and_start("a", lambda rid: None, lambda: None)
        b = registry.open_and_start("b", lambda rid: None, lambda: None)
        # Two steps' deltas before the reader looks (it is behind the engine), then a's end; one of nobody's.
        registry.deliver_all([_delta("a", False), _delta("b", False), _delta("gone", False)])
        registry.deliver_all([_delta("a", False), _delta("b", True)])
        registry.deliver_all([_delta("a", True), _delta("a", False)])  # (after its end: dropped)
        await asyncio.sleep(0)  # (the hand-offs run on the loop)
        batches = [[(d.request_id, d.finished) for d in batch] async for batch in a.batches()]
        return batches, [(d.request_id, d.finished) async for d in b]

    batches, b = asyncio.run(run())
    assert batches == [[("a", False), ("a", False), ("a", True)]]  # every delta waiting, in one batch, to the end
    assert b == [("b", False), ("b", True)]


def test_a_stream_whose_event_loop_closed_is_dropped_and_delivery_goes_on() -> None:
    registry = StreamRegistry()

    async def open_one() -> None:
        registry.open_and_start("left", lambda rid: None, lambda: None)

    asyncio.run(open_one())  # (its loop closes with the stream still open: a reader that failed)

    async def run() -> list[bool]:
        stream = registry.open_and_start("r", lambda rid: None, lambda: None)
        registry.deliver_all([_delta("left", False), _delta("r", True)])  # (the engine loop's thread: no raise)
        return [d.finished async for d in stream]

    assert asyncio.run(run()) == [True]
    assert "left" not in registry
    # One delta at a time (a cluster's poller), and failing every stream (the engine loop stopped), take the same way.
    asyncio.run(open_one())
    registry.deliver(_delta("left", False))
    assert "left" not in registry
    asyncio.run(open_one())
    assert registry.fail_all("stopped") == ["left"]
