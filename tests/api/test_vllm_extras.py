"""vLLM's request extensions that agents' frameworks send, through the real `openai` client on SmolLM2:
``allowed_token_ids``, ``bad_words``, ``return_tokens_as_token_ids`` and ``return_token_ids`` (chat and completions,
streamed or not), and ``GET /version``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from boundless import __version__
from boundless.api.launch import ServerThread, start_in_thread
from boundless.config import ServerConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

MODEL = "smollm2-135m"
STORY = "Once upon a time, there was a little girl named"


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel) -> Iterator[ServerThread]:
    engine = AsyncEngine(EngineCore.from_model(smollm2, engine_config(MODEL, max_model_len=512, kv_cache_gb=0.05)))
    srv = start_in_thread(engine, MODEL)
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _ids(tokens: list[str]) -> list[int]:
    """The ids of tokens named ``token_id:<id>`` (each must be)."""
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_completions_name_tokens_by_id_echo_and_stream_alike_and_hold_to_allowed_ids(
    client: openai.OpenAI, smollm2: LoadedModel
) -> None:
    allowed = sorted({*smollm2.tokenizer.encode(" the beach and the sun, a dog"), *smollm2.tokenizer.eos_token_ids})
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True, "allowed_token_ids": allowed}
    ask: dict[str, Any] = {"model": MODEL, "prompt": STORY, "max_tokens": 8, "temperature": 0.0, "logprobs": 2}
    r = client.completions.create(**ask, echo=True, extra_body=extra).model_dump()["choices"][0]
    prompt, output = r["prompt_token_ids"], r["token_ids"]
    assert set(output) <= set(allowed)
    assert _ids(r["logprobs"]["tokens"]) == prompt + output  # the echoed prompt's tokens too
    assert r["logprobs"]["top_logprobs"][0] is None  # (the prompt's first token has no logprob)
    assert all(_ids(list(top)) for top in r["logprobs"]["top_logprobs"][1:])
    assert r["logprobs"]["text_offset"][len(prompt)] == len(r["text"]) - len(smollm2.tokenizer.decode(output))
    streamed = []
    for chunk in client.completions.create(**ask, stream=True, extra_body=extra):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.tokens
            assert all(_ids(list(top)) for top in chunk.choices[0].logprobs.top_logprobs)
    assert _ids(streamed) == output
    plain = client.completions.create(**ask).choices[0].logprobs.tokens
    assert not any(t.startswith("token_id:") for t in plain)  # (only when asked)


def test_streamed_completions_carry_their_token_ids_as_vllm_streams_them(client: openai.OpenAI) -> None:
    """vLLM's ``return_token_ids`` streamed: each choice's first chunk carries its prompt's ids, every chunk the ids of
    its new tokens; together the same ids as the response not streamed."""
    ask: dict[str, Any] = {"model": MODEL, "prompt": [STORY, "The capital of France is"], "max_tokens": 6, "n": 2}
    ask |= {"temperature": 0.0, "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    whole = client.completions.create(**ask).model_dump()["choices"]
    assert all(len(c["token_ids"]) == 6 for c in whole)
    prompts: dict[int, list] = {}
    outputs: dict[int, list[int]] = {i: [] for i in range(4)}
    for chunk in client.completions.create(**ask, stream=True):
        for c in chunk.model_dump()["choices"]:
            if c["index"] not in prompts:
                prompts[c["index"]] = c["prompt_token_ids"]
            else:
                assert c["prompt_token_ids"] is None  # (the first chunk's alone)
            outputs[c["index"]] += c["token_ids"]
    assert prompts == {c["index"]: c["prompt_token_ids"] for c in whole}
    assert outputs == {c["index"]: c["token_ids"] for c in whole}
    plain = next(iter(client.completions.create(**ask | {"extra_body": {}}, stream=True))).model_dump()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain  # (only when asked)


def test_chat_carries_its_token_ids_streamed_or_not_as_vllm_sends_them(client: openai.OpenAI) -> None:
    """vLLM's ``return_token_ids`` on chat: the prompt's ids beside the choices (streamed: in each choice's first
    chunk), each choice's output ids in it (streamed: every chunk its tokens'); the same ids either way."""
    ask: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}], "n": 2}
    ask |= {"max_tokens": 6, "temperature": 0.0, "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    whole = client.chat.completions.create(**ask).model_dump()
    assert whole["prompt_token_ids"] and all(len(c["token_ids"]) == 6 for c in whole["choices"])
    prompts, outputs = [], {0: [], 1: []}
    for chunk in client.chat.completions.create(**ask, stream=True):
        data = chunk.model_dump()
        if data.get("prompt_token_ids") is not None:
            prompts.append(data["prompt_token_ids"])
        for c in data["choices"]:
            outputs[c["index"]] += c.get("token_ids") or []
    assert prompts == [whole["prompt_token_ids"]] * 2  # (each choice's first chunk)
    assert outputs == {c["index"]: c["token_ids"] for c in whole["choices"]}
    plain = client.chat.completions.create(**ask | {"extra_body": {}}).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]  # (only when asked)


def test_chat_logprobs_name_tokens_by_id_streamed_or_not_and_prompt_logprobs_keep_their_text(
    client: openai.OpenAI,
) -> None:
    ask: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 6,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    r = client.chat.completions.create(**ask, extra_body={"return_tokens_as_token_ids": True, "prompt_logprobs": 1})
    content = r.choices[0].logprobs.content
    ids = _ids([t.token for t in content])
    # vLLM's: a sampled token's bytes are its text's (the client's way to the text), an alternative's its name's.
    assert all(alt.bytes == list(alt.token.encode()) for t in content for alt in t.top_logprobs)
    assert all(_ids([alt.token for alt in t.top_logprobs]) for t in content)
    plain = client.chat.completions.create(**ask).choices[0]
    texts = [t.token for t in plain.logprobs.content]
    assert "".join(texts) == plain.message.content and len(texts) == len(ids)
    assert [t.bytes for t in content] == [t.bytes for t in plain.logprobs.content]
    prompt_logprobs = r.model_dump()["prompt_logprobs"]  # (vLLM leaves them as they are: keyed by id, with text)
    assert not any(e["decoded_token"].startswith("token_id:") for entry in prompt_logprobs[1:] for e in entry.values())
    streamed = []
    for chunk in client.chat.completions.create(**ask, stream=True, extra_body={"return_tokens_as_token_ids": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += [t.token for t in chunk.choices[0].logprobs.content or ()]
    assert _ids(streamed) == ids


def test_a_banned_word_reaches_the_engine_from_chat_and_completions(client: openai.OpenAI) -> None:
    ask: dict[str, Any] = {"model": MODEL, "prompt": STORY, "max_tokens": 20, "temperature": 0.0}
    plain = client.completions.create(**ask).choices[0].text
    banned = client.completions.create(**ask, extra_body={"bad_words": ["the beach"]}).choices[0].text
    assert banned.startswith(plain[: plain.index("the beach") + len("the")]) and "the beach" not in banned
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    said = client.chat.completions.create(**chat, max_tokens=12, temperature=0.0).choices[0].message.content
    assert "Paris" in said
    extra = {"bad_words": ["Paris"]}
    again = client.chat.completions.create(**chat, max_tokens=12, temperature=0.0, extra_body=extra)
    assert "Paris" not in again.choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [49152]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": ["  "]}, "bad_words"),
    ],
)
def test_bad_values_are_400s_naming_the_parameter(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body=extra
        )
    assert err.value.body["param"] == param


def test_version_is_vllms_route(server: ServerThread) -> None:
    r = httpx.get(server.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": __version__}


def test_the_servers_logprobs_flags_raise_the_alternatives_and_name_tokens_by_id(smollm2: LoadedModel) -> None:
    """``--max-logprobs`` past OpenAI's 20 (vLLM's flag): chat's ``top_logprobs``, completions' ``logprobs`` and
    ``prompt_logprobs`` up to it are served, each token with that many alternatives; past it a 400 naming the field.
    ``--return-tokens-as-token-ids``: tokens named by id unless a request says otherwise."""
    engine = AsyncEngine(
        EngineCore.from_model(smollm2, engine_config(MODEL, max_model_len=512, kv_cache_gb=0.05, max_logprobs=30))
    )
    srv = start_in_thread(engine, MODEL, ServerConfig(return_tokens_as_token_ids=True))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        by_id = client.completions.create(model=MODEL, prompt=STORY, max_tokens=3, logprobs=1, temperature=0)
        assert by_id.choices[0].logprobs is not None and by_id.choices[0].logprobs.tokens
        by_text = client.completions.create(
            model=MODEL, prompt=STORY, max_tokens=3, logprobs=1, temperature=0,
            extra_body={"return_tokens_as_token_ids": False},
        )  # fmt: skip
        assert by_text.choices[0].logprobs is not None and by_text.choices[0].logprobs.tokens
        assert "".join(by_text.choices[0].logprobs.tokens) == by_text.choices[0].text
        assert smollm2.tokenizer.decode(_ids(by_id.choices[0].logprobs.tokens)) == by_text.choices[0].text
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, logprobs=True, top_logprobs=30
        )
        content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
        assert content and all(len(t.top_logprobs) == 30 for t in content)
        done = client.completions.create(
            model=MODEL, prompt=STORY, max_tokens=2, logprobs=25, extra_body={"prompt_logprobs": 30}
        )
        assert done.choices[0].logprobs is not None and done.choices[0].logprobs.top_logprobs
        assert all(len(alternatives) >= 25 for alternatives in done.choices[0].logprobs.top_logprobs)
        scored = done.model_extra["choices"][0]["prompt_logprobs"] if done.model_extra else None
        scored = scored or done.choices[0].model_extra["prompt_logprobs"]
        assert all(len(position) in (30, 31) for position in scored[1:])
        for call, param in (
            (lambda: client.completions.create(model=MODEL, prompt=STORY, max_tokens=1, logprobs=31), "logprobs"),
            (
                lambda: client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=31
                ),
                "top_logprobs",
            ),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                call()
            assert refused.value.body["param"] == param and "--max-logprobs" in refused.value.body["message"]
    finally:
        srv.stop()
        engine.shutdown()


def test_a_forced_call_cut_off_is_a_call_in_responses_as_in_chat(client: openai.OpenAI) -> None:
    """SmolLM2's template names no call format, so a forced call (``tool_choice: required``) is written as bare JSON by
    its grammar. Cut off by the limit inside it, chat returned the call as far as it got, and the Responses API the
    JSON as a message's text: now a function call item there too, incomplete, with the same arguments."""
    tool = {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    for limit in (22, 30):
        response = client.responses.create(
            model=MODEL, input="Weather in Paris", tools=[{"type": "function", **tool}], tool_choice="required",
            max_output_tokens=limit, temperature=0,
        )  # fmt: skip
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris"}],
            tools=[{"type": "function", "function": tool}], tool_choice="required", max_tokens=limit, temperature=0,
        )  # fmt: skip
        expected = [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls or ()]
        assert expected, "chat read no call"
        assert response.status == "incomplete"
        assert [(o.type, o.name, o.arguments) for o in response.output if o.type == "function_call"] == [
            ("function_call", name, arguments) for name, arguments in expected
        ]
        assert not [o for o in response.output if o.type == "message"]
