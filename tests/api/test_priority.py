"""vLLM's request ``priority`` through the server: a class of service, smaller first, on every route."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from boundless.api.launch import start_in_thread
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import LLM, engine_config
from boundless.model.loader import load_model
from boundless.model.random_model import TinySpec, write_random_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("priority") / "m", TinySpec())


@pytest.fixture(scope="module")
def one_slot(model_dir: Path) -> Iterator[str]:
    """The model served with one sequence slot, first come first served: only ``priority`` can reorder calls."""
    config = engine_config(str(model_dir), max_model_len=2048, kv_cache_gb=0.05, max_num_seqs=1, policy="fcfs")
    engine = AsyncEngine(EngineCore.from_model(load_model(str(model_dir)), config))
    server = start_in_thread(engine, "tiny")
    try:
        yield server.url
    finally:
        server.stop()
        engine.shutdown()


def test_a_call_of_a_smaller_priority_runs_before_one_in_flight(one_slot: str) -> None:
    """A long stream of priority 1 holds the only slot; a call of priority 0 sent while it runs is answered before
    the stream ends (first come first served alone would make it wait for the stream's 2,000 tokens)."""
    client = openai.OpenAI(base_url=one_slot + "/v1", api_key="x", max_retries=0)
    events: list[str] = []
    long_call = {"ignore_eos": True, "priority": 1}
    stream = client.completions.create(
        model="tiny", prompt="a b c", max_tokens=2000, temperature=0, stream=True, extra_body=long_call
    )
    chunks = iter(stream)
    next(chunks)  # the long call is running

    def drain() -> None:
        for _ in chunks:
            pass
        events.append("long call ended")

    reader = threading.Thread(target=drain)
    reader.start()
    urgent = client.completions.create(
        model="tiny", prompt="x y", max_tokens=3, temperature=0, extra_body={"ignore_eos": True, "priority": 0}
    )
    events.append("urgent call answered")
    reader.join(timeout=300)
    assert urgent.usage.completion_tokens == 3
    assert events == ["urgent call answered", "long call ended"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("value", [1.5, "high", True])
def test_priority_that_is_not_an_integer_is_a_400(one_slot: str, route: str, value: object) -> None:
    body: dict[str, object] = {"model": "tiny", "max_tokens": 2, "priority": value}
    if route == "/v1/completions":
        body["prompt"] = "a"
    elif route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "a"}]
    else:
        body = {"model": "tiny", "input": "a", "max_output_tokens": 2, "priority": value}
    r = httpx.post(one_slot + route, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text


def test_offline_priorities_are_one_a_prompt(model_dir: Path) -> None:
    """``LLM.generate(priority=[...])`` (vLLM's): one class a prompt; the answers are those without it."""
    llm = LLM(str(model_dir), max_model_len=256, kv_cache_gb=0.02, max_num_seqs=1)
    params = SamplingParams(max_tokens=4, temperature=0)
    plain = llm.generate(["a b", "c d"], params)
    ranked = llm.generate(["a b", "c d"], params, priority=[3, -1])
    assert [r.outputs[0].token_ids for r in ranked] == [r.outputs[0].token_ids for r in plain]
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate(["a b", "c d"], params, priority=[0])
