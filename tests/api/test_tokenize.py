"""vLLM's ``/tokenize`` and ``/detokenize`` on a served random model: the ids the completion and chat routes would
feed the engine, their count against the context, and back to text; bad input gets a 400 or a 404."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from served_models import Served, serve_hermes


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve_hermes(tmp_path_factory.mktemp("tokenize")) as s:
        yield s


def _post(served: Served, route: str, body: dict) -> httpx.Response:
    # (json.dumps escapes a lone surrogate, which httpx's own encoding cannot send)
    return httpx.post(
        served.url + route, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=30
    )


def test_tokenize_a_prompt_and_back(served: Served) -> None:
    tokenizer = served.loaded.tokenizer
    text = "The quick brown fox jumps over the lazy dog."
    reply = _post(served, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    assert reply.status_code == 200
    body = reply.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == served.engine.max_model_len
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    plain = _post(served, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False) and plain["token_strs"] is None
    back = _post(served, "/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == tokenizer.decode(body["tokens"], False)


def test_tokenize_a_chat_as_the_chat_route_sees_it(served: Served) -> None:
    """The chat form's ids are the prompt the chat route runs: its usage counts the same tokens."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = _post(served, "/tokenize", {"model": "tiny", "messages": messages, "tools": tools}).json()
    chat = served.client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=1)
    assert body["count"] == chat.usage.prompt_tokens
    no_tools = _post(served, "/tokenize", {"messages": messages}).json()
    assert no_tools["count"] < body["count"]  # the template wrote the tools into the first
    open_turn = _post(served, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert open_turn["count"] < no_tools["count"]


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ("/tokenize", {"prompt": "a\ud800b"}, 400, "prompt"),  # a lone surrogate (was a 500)
        ("/tokenize", {"messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "messages.0.content"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": []}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
    ],
)
def test_bad_input(served: Served, route: str, body: dict, status: int, param: str) -> None:
    reply = _post(served, route, body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param
