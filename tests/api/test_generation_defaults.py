"""A model's sampling defaults (its ``generation_config.json``) applied to what requests leave out, as vLLM's
``--generation-config auto`` does, through the real server and `openai` client; ``vllm`` keeps the API's own."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from served_models import Served, serve_hermes

from boundless.config import ServerConfig


@pytest.fixture(scope="module", params=["auto", "vllm"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Served]]:
    # Greedy by default, 5 tokens at most: what a request that sets neither then gets (--generation-config auto).
    config = {"temperature": 0.0, "max_new_tokens": 5}
    with serve_hermes(
        tmp_path_factory.mktemp(f"genconfig-{request.param}"),
        server_config=ServerConfig(generation_config=request.param),
        generation_config=config,
    ) as s:
        yield request.param, s


def test_omitted_parameters_take_the_models_defaults(served: tuple[str, Served]) -> None:
    mode, s = served
    messages = [{"role": "user", "content": "Tell me about the fox."}]

    def chat(**kwargs) -> tuple[str, int]:
        reply = s.client.chat.completions.create(model="tiny", messages=messages, seed=1, **kwargs)
        return reply.choices[0].message.content, reply.usage.completion_tokens

    greedy = chat(temperature=0, max_tokens=5, extra_body={"min_tokens": 5})
    plain = chat(extra_body={"min_tokens": 5})
    if mode == "auto":
        assert plain == greedy  # greedy and 5 tokens, from generation_config.json
    else:
        assert plain != greedy and plain[1] > 5  # the API's own: temperature 1, to the context's end
    # A value the request gives wins over the model's.
    assert chat(temperature=0, max_tokens=3)[1] == 3


def test_the_models_default_max_tokens_is_capped_to_the_context_left(served: tuple[str, Served]) -> None:
    """A prompt 3 tokens short of the context: with the model's default of 5 tokens (``auto``) the request runs to the
    context's end, as vLLM caps a default, where it was refused for tokens the client never asked for; a limit the
    client sets is still checked whole (400)."""
    _, s = served

    def prompt_tokens(text: str) -> int:
        body = {"model": "tiny", "messages": [{"role": "user", "content": text}]}
        return httpx.post(s.url + "/tokenize", json=body, timeout=60).json()["count"]

    # The most words that fit (by halves: a /tokenize call each), then single letters up to the mark.
    fit, over = 0, 1000
    while over - fit > 1:
        mid = (fit + over) // 2
        fit, over = (mid, over) if prompt_tokens("fox " * mid) <= 1024 - 3 else (fit, mid)
    text = "fox " * fit
    while prompt_tokens(text + "a") <= 1024 - 3:
        text += "a"
    assert prompt_tokens(text) == 1024 - 3
    messages = [{"role": "user", "content": text}]
    reply = s.client.chat.completions.create(model="tiny", messages=messages, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    response = s.client.responses.create(model="tiny", input=text, extra_body={"ignore_eos": True})
    assert response.usage.output_tokens == 3 and response.status == "incomplete"
    with pytest.raises(Exception, match="maximum context length"):
        s.client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)


@pytest.fixture(scope="module", params=["directory", "override"])
def served_given_defaults(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A model whose own generation_config.json says nothing useful, greedy and 5 tokens given by vLLM's other two
    forms: ``--generation-config DIR`` (that directory's file) and ``--override-generation-config JSON``."""
    given = {"temperature": 0.0, "max_new_tokens": 5}
    if request.param == "directory":
        directory = tmp_path_factory.mktemp("genconfig-dir")
        (directory / "generation_config.json").write_text(json.dumps(given))
        config = ServerConfig(generation_config=str(directory))
    else:
        config = ServerConfig(generation_config="vllm", override_generation_config=json.dumps(given))
    with serve_hermes(
        tmp_path_factory.mktemp(f"genconfig-{request.param}"),
        server_config=config,
        generation_config={"temperature": 1.0, "max_new_tokens": 500},
    ) as s:
        yield s


def test_defaults_from_a_directory_or_vllms_overrides_apply_to_what_requests_omit(
    served_given_defaults: Served,
) -> None:
    """vLLM's ``--generation-config`` takes a directory too, and ``--override-generation-config`` a JSON object: a vLLM
    command line with either stopped at start-up here (``must be auto or vllm``; argparse's "unrecognized
    arguments")."""
    s = served_given_defaults
    messages = [{"role": "user", "content": "Tell me about the fox."}]

    def chat(**kwargs) -> tuple[str, int]:
        reply = s.client.chat.completions.create(model="tiny", messages=messages, seed=1, **kwargs)
        return reply.choices[0].message.content, reply.usage.completion_tokens

    assert chat(extra_body={"min_tokens": 5}) == chat(temperature=0, max_tokens=5, extra_body={"min_tokens": 5})
