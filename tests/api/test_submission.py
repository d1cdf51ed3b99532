"""A request's samples are submitted off the event loop (``OpenAIServer.submit``): a submission that takes its time
(a cluster's round trip to an instance for each sample) holds no other request of the server, and a client that
goes while its request is submitted leaves nothing running."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from boundless.api.launch import ServerThread, start_in_thread
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

ROUND_TRIP_S = 0.02  # what a cluster's instance takes to answer a sample's submission


class RemoteEngine(AsyncEngine):
    """An engine whose requests are taken as an instance across a network takes them: a round trip each."""

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *args, **kwargs) -> None:
        time.sleep(ROUND_TRIP_S)
        super().add(request_id, prompt_token_ids, params, *args, **kwargs)


@pytest.fixture
def served(tiny_llama: LoadedModel, model_dirs: dict[str, Path]) -> Iterator[tuple[ServerThread, RemoteEngine]]:
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=256, kv_cache_gb=0.05)
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
    server, _ = served
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "n": 32}  # 32 round trips: 0.64 s
    worst = 0.0
    done = threading.Event()

    def poll() -> None:
        nonlocal worst
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                start = time.perf_counter()
                assert client.get(server.url + "/health").status_code == 200
                worst = max(worst, time.perf_counter() - start)
                time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    finally:
        done.set()
        poller.join()
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 32
    # Held on the event loop, /health waited out the submission (0.64 s of round trips).
    assert worst < 32 * ROUND_TRIP_S / 2, worst


def test_a_client_gone_while_its_request_is_submitted_leaves_nothing_running(
    served: tuple[ServerThread, RemoteEngine],
) -> None:
    server, engine = served
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "n": 16}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.1)  # (gone within the submission's 0.32 s)
    deadline = time.monotonic() + 30
    while engine.core.has_unfinished() or engine.streams._streams:
        assert time.monotonic() < deadline, "the gone client's samples kept running"
        time.sleep(0.05)
