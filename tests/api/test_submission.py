"""A request's samples are submitted off the event loop (``OpenAIServer.submit``): a submission that takes its time
(a cluster's round trip to an instance for each sample) holds no other request of the server, and a client that
goes while its request is submitted leaves nothing running."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from boundless.api.launch import ServerThread, start_in_thread
from boundless.api.server import OpenAIServer
from boundless.config import ServerConfig
from boundless.engine.async_engine import SHUTTING_DOWN, AsyncEngine
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

ROUND_TRIP_S = 0.02  # what a cluster's instance takes to answer a sample's submission
REPLY_WAIT_S = 10.0  # the most a round trip waits for its reply


class RemoteEngine(AsyncEngine):
    """An engine whose requests are taken as an instance across a network takes them: a round trip each. With a
    ``reply`` event, a round trip lasts until it is set (at most ``REPLY_WAIT_S``): what else the server answers
    meanwhile shows whether the submission holds it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reply: threading.Event | None = None
        self.submitting = threading.Event()  # (set once a round trip has begun)
        self.replies_waited_out: list[str] = []

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *args, **kwargs) -> None:
        self.submitting.set()
        if self.reply is not None:
            if not self.reply.wait(REPLY_WAIT_S):
                self.replies_waited_out.append(request_id)
        else:
            time.sleep(ROUND_TRIP_S)
        super().add(request_id, prompt_token_ids, params, *args, **kwargs)


@pytest.fixture
def served(tiny_llama: LoadedModel, model_dirs: dict[str, Path]) -> Iterator[tuple[ServerThread, RemoteEngine]]:
    # (A context long enough that no sample ends on its own while the others are submitted.)
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=2048, kv_cache_gb=0.1)
    engine = RemoteEngine(EngineCore.from_model(tiny_llama, config))
    server = start_in_thread(engine, "tiny")
    try:
        yield server, engine
    finally:
        server.stop()
        engine.shutdown()


def test_a_request_of_many_samples_holds_no_other_request_while_it_is_submitted(
    served: tuple[ServerThread, RemoteEngine],
) -> None:
    """A sample's round trip lasts until the server has answered a ``/health`` asked after it began: on the event
    loop, the submission held ``/health`` until the round trip gave up waiting for it."""
    server, engine = served
    engine.reply = threading.Event()
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "n": 4}
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                asked_during_submission = engine.submitting.is_set()
                assert client.get(server.url + "/health").status_code == 200
                if asked_during_submission:
                    engine.reply.set()  # type: ignore[union-attr]
                time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    finally:
        done.set()
        poller.join()
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 4
    assert engine.replies_waited_out == []  # (every round trip had its reply: /health was answered meanwhile)


def _finishes(engine: RemoteEngine) -> dict[str, str | None]:
    """Each request's finish reason as the engine ends it (listened to from the engine's thread)."""
    ended: dict[str, str | None] = {}
    engine.add_finished_listener(lambda delta: ended.__setitem__(delta.request_id, delta.finish_reason))
    return ended


def _wait_until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_request_cancelled_while_it_is_submitted_has_every_sample_aborted(
    served: tuple[ServerThread, RemoteEngine],
) -> None:
    """The route's task cancelled (its client gone, uvicorn shutting down) while the samples are submitted on the
    worker thread: once they are, every one is aborted, none runs on for nobody."""
    _, engine = served
    ended = _finishes(engine)
    server = OpenAIServer(engine, "tiny", ServerConfig())
    params = SamplingParams(n=16, max_tokens=2000, ignore_eos=True, temperature=1.0)

    async def cancelled_midway() -> None:
        task = asyncio.create_task(server.submit("gone", [[5, 6, 7]], params, None))
        await asyncio.sleep(3 * ROUND_TRIP_S)  # (a few of the 16 samples submitted)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(20 * ROUND_TRIP_S)  # (the loop runs on while the rest are submitted, then aborted)

    asyncio.run(cancelled_midway())
    _wait_until(lambda: len(ended) == 16, "not every sample ended")
    assert set(ended.values()) == {"abort"}, ended


def test_a_request_started_as_the_server_shuts_down_does_not_run_on(
    served: tuple[ServerThread, RemoteEngine],
) -> None:
    """The server's requests ended (shutting down) between a sample's stream opening and its request's start on the
    worker thread: the abort that went with it found no request yet, and the request ran to its end for nobody."""
    _, engine = served
    ended = _finishes(engine)
    server = OpenAIServer(engine, "tiny", ServerConfig())

    async def shut_down_midway() -> list:
        task = asyncio.create_task(server.submit("late", [[5, 6, 7]], SamplingParams(max_tokens=2000), None))
        await asyncio.sleep(ROUND_TRIP_S / 2)  # (its stream open, its request not yet started)
        engine.end_requests()
        return [delta async for delta in (await task)[0]]

    (delta,) = asyncio.run(shut_down_midway())
    assert delta.finish_reason == "error" and delta.stop_reason == SHUTTING_DOWN
    _wait_until(lambda: "late-0-0" in ended, "the request did not end")
    assert ended["late-0-0"] == "abort"
