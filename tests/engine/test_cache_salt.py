"""vLLM's ``cache_salt``: the prefix cache shares KV only among requests with the same salt, and the outputs do not
change; served, the field is taken by chat, completions and the Responses API."""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest

from boundless.api.launch import start_in_thread
from boundless.config import CacheConfig, EngineConfig, ModelConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import InvalidSamplingParams, SamplingParams
from boundless.model.loader import LoadedModel

PROMPT = [(7 * j) % 300 + 3 for j in range(80)]  # five full blocks of 16


def _engine(loaded: LoadedModel) -> EngineCore:
    config = EngineConfig(model=ModelConfig(max_model_len=512), cache=CacheConfig(num_kv_blocks=128))
    return EngineCore.from_model(loaded, config)


def _run(core: EngineCore, rid: str, params: SamplingParams) -> tuple[list[int], int]:
    """The request's tokens, and the prompt tokens it found cached."""
    request = core.add_request(rid, PROMPT, params)
    tokens: list[int] = []
    while core.has_unfinished():
        for delta in core.step():
            tokens += delta.new_token_ids
    return tokens, request.num_cached_tokens


def test_a_salt_shares_kv_only_with_the_same_salt(tiny_llama: LoadedModel) -> None:
    core = _engine(tiny_llama)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    salted = dataclasses.replace(params, cache_salt="tenant-a")
    first, cached = _run(core, "a1", salted)
    assert cached == 0
    again, cached = _run(core, "a2", salted)
    assert again == first and cached == 64  # its own salt's blocks (all but the last, which it computes)
    other, cached = _run(core, "b", dataclasses.replace(params, cache_salt="tenant-b"))
    assert other == first and cached == 0
    plain, cached = _run(core, "none", params)
    assert plain == first and cached == 0
    plain, cached = _run(core, "none2", params)
    assert cached == 64
    # What a prefill engine says it holds is counted per salt too.
    assert core.memory_prefix_blocks(PROMPT, salted) == core.memory_prefix_blocks(PROMPT) == 5
    assert core.memory_prefix_blocks(PROMPT, dataclasses.replace(params, cache_salt="tenant-c")) == 0


def test_an_empty_salt_is_refused() -> None:
    with pytest.raises(InvalidSamplingParams, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_served_cache_salt(tiny_llama: LoadedModel) -> None:
    engine = AsyncEngine(_engine(tiny_llama))
    server = start_in_thread(engine, "tiny")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    def cached(salt: str | None) -> int:
        extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt else {})
        reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    try:
        assert cached("s1") == 0
        assert cached("s1") == 64
        assert cached("s2") == 0
        assert cached(None) == 0
        text = "Tell me about the weather in Paris and in Rome, and which of them is warmer in the spring. " * 2

        def chat_cached(salt: str) -> int:
            chat = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": text}],
                max_tokens=2,
                extra_body={"cache_salt": salt},
            )
            return chat.usage.prompt_tokens_details.cached_tokens

        assert chat_cached("c1") == 0 and chat_cached("c1") > 0 and chat_cached("c2") == 0

        def response_cached(salt: str) -> int:
            reply = client.responses.create(
                model="tiny", input=text, max_output_tokens=2, extra_body={"cache_salt": salt}
            )
            return reply.usage.input_tokens_details.cached_tokens

        assert response_cached("r1") == 0 and response_cached("r1") > 0 and response_cached("r2") == 0
        bad = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "cache_salt": ""})
        assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["param"]
    finally:
        server.stop()
        engine.shutdown()
