"""SIGINT or SIGTERM with requests in flight: each ends with an OpenAI error object, and the server exits promptly."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from boundless.api.launch import start_in_thread
from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.sim.cost import CostModel
from boundless.sim.engine import SimulatedModel, simulated_engine


def _engine() -> AsyncEngine:
    config = EngineConfig(ModelConfig(max_model_len=8192), CacheConfig(num_kv_blocks=4096), SchedulerConfig())
    return AsyncEngine(simulated_engine(config, SimulatedModel.read(ModelConfig()), CostModel(), time.monotonic))


def test_a_signal_ends_the_requests_in_flight_with_error_objects() -> None:
    engine = _engine()
    server = start_in_thread(engine, "m")
    results: dict[str, object] = {}
    long = {"model": "m", "max_tokens": 8000, "ignore_eos": True}

    def stream(i: int) -> None:
        body = {**long, "messages": [{"role": "user", "content": "Tell a long story"}], "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
            results[f"s{i}"] = [line for line in r.iter_lines() if line]

    def completion_stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**long, "prompt": "x", "stream": True}) as r:
            results["cs"] = [line for line in r.iter_lines() if line]

    def response_stream() -> None:
        body = {"model": "m", "input": "Tell a long story", "max_output_tokens": 8000, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "ignore_eos": True}, timeout=60) as r:
            results["rs"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    def unary() -> None:
        r = httpx.post(f"{server.url}/v1/completions", json={**long, "prompt": "x"}, timeout=60)
        results["u"] = (r.status_code, r.headers["content-type"], r.json())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=f) for f in (completion_stream, response_stream, unary)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while engine.stats()["0"].num_running < len(threads) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # (some tokens out)
        server.server.handle_exit(signal.SIGINT, None)  # what the signal calls
        for t in threads:
            t.join(timeout=30)
        server.thread.join(timeout=30)
    finally:
        server.stop()
        engine.shutdown()

    status, content_type, body = results["u"]  # type: ignore[misc]
    assert (status, content_type) == (503, "application/json")
    assert body["error"]["code"] == "server_shutting_down" and body["error"]["type"] == "server_error"
    for key in ("s0", "s1", "cs"):
        lines = results[key]
        assert isinstance(lines, list) and lines[-1] == "data: [DONE]", (key, lines[-3:])
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down", (key, error)
        finish = json.loads(lines[-3].removeprefix("data: "))["choices"][0]["finish_reason"]
        assert finish == "error", (key, lines[-3])
    # The Responses API's stream fails with the same error object (it said the engine had failed).
    failed = json.loads(results["rs"][-1].removeprefix("data: "))  # type: ignore[index]
    assert failed["type"] == "response.failed" and failed["response"]["error"]["code"] == "server_shutting_down"


def test_a_request_after_the_signal_is_refused_with_an_error_object() -> None:
    engine = _engine()
    server = start_in_thread(engine, "m")
    try:
        engine.end_requests()  # (as the signal does, the server not yet closed)
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3})
    finally:
        server.stop()
        engine.shutdown()
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"


def test_a_request_cancelled_before_its_response_gets_the_error_object() -> None:
    """uvicorn cancels what still runs when its graceful shutdown times out, a body still arriving among them (read by
    the body limit, outside the routes' error handling): the outermost layer answers a response not yet begun with the
    503 object, where Starlette's last resort sent a plain-text 500 and a traceback."""
    import asyncio

    from boundless.api.errors import CancelledRequests

    async def reading_forever(scope: dict, receive: object, send: object) -> None:
        raise asyncio.CancelledError

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    asyncio.run(CancelledRequests(reading_forever)({"type": "http", "method": "POST", "path": "/x"}, receive, send))
    assert sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["code"] == "server_shutting_down"
