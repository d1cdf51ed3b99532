"""A real server on 127.0.0.1, driven by the official ``openai`` client (sync and async) and raw HTTP."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from served_models import streamed_chat

from boundless import LLM, SamplingParams
from boundless.api.launch import ServerThread, start_in_thread
from boundless.api.schemas import ChatCompletionRequest, CompletionRequest
from boundless.api.server import sampling_params
from boundless.config import ServerConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import GRANT_REFUSED, EngineCore, RequestDelta
from boundless.engine.sampling_params import RequestOutputKind
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel

MODEL = "smollm2-135m"
MAX_LEN = 1024


def _engine(loaded: LoadedModel, max_waiting: int = 512, **kwargs) -> AsyncEngine:
    kwargs.setdefault("max_model_len", MAX_LEN)
    kwargs.setdefault("kv_cache_gb", 0.25)
    return AsyncEngine(EngineCore.from_model(loaded, engine_config(loaded.name, **kwargs)), max_waiting=max_waiting)


@pytest.fixture(scope="module")
def engine(smollm2: LoadedModel) -> Iterator[AsyncEngine]:
    eng = _engine(smollm2)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: AsyncEngine) -> Iterator[ServerThread]:
    srv = start_in_thread(engine, MODEL)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aclient(server: ServerThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _good_request(client: openai.OpenAI) -> None:
    """After any rejected request, the server still serves."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


# -- behaviour ---------------------------------------------------------------------------------


@pytest.mark.slow  # (6 s of waiting past the keep-alive)
def test_an_idle_connection_outlives_the_clients_pool_expiry(server: ServerThread) -> None:
    """The server keeps an idle keep-alive connection open past httpx's 5 s pool expiry, so a client never sends
    a call on a connection the server is closing at that very moment (a failed call, with retries off)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port)  # one connection, never reopened by itself
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() == b'{"status":"ok"}'
        sock = conn.sock
        time.sleep(6.0)  # past uvicorn's default keep-alive (5 s), which closed the connection here
        conn.request("GET", "/health")
        assert conn.getresponse().read() == b'{"status":"ok"}' and conn.sock is sock
    finally:
        conn.close()


def test_models_and_health(server: ServerThread, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL) == models.data[0]  # OpenAI's retrieve
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/none-such")
    assert missing.value.code == "model_not_found" and "none-such" in missing.value.message
    listing = httpx.get(server.url + "/v1/models/", follow_redirects=True)  # (a slash at its end: the listing still)
    assert listing.status_code == 200 and [m["id"] for m in listing.json()["data"]] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chat_usage_matches_the_tokenizer(client: openai.OpenAI, engine: AsyncEngine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    tok = engine.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt_ids)
    text = r.choices[0].message.content
    assert r.usage.completion_tokens >= len(tok.encode(text, add_special_tokens=False)) - 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].message.role == "assistant"


def test_text_parts_reach_the_template_joined_by_newlines(client: openai.OpenAI, engine: AsyncEngine) -> None:
    """A message's text parts are one text to the template, joined by newlines as vLLM joins them (they were joined
    with nothing between: "Hellothere")."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=1, extra_body={"return_token_ids": True}
    )
    tok = engine.tokenizer
    joined = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Hello\nthere"}]), add_special_tokens=False
    )
    assert r.model_extra["prompt_token_ids"] == joined


def test_the_responses_apis_text_parts_and_a_refusal_read_as_text(client: openai.OpenAI, engine: AsyncEngine) -> None:
    """vLLM's reading of content parts: input_text and output_text (a Responses client's, sent to chat) and an
    assistant's refusal are text. They were a 400."""
    messages = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "user", "content": [{"type": "output_text", "text": "Why"}, {"type": "input_text", "text": "not"}]},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"return_token_ids": True}
    )  # type: ignore[arg-type]
    tok = engine.tokenizer
    plain = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "No."},
        {"role": "user", "content": "Why\nnot"},
    ]
    assert r.model_extra["prompt_token_ids"] == tok.encode(tok.apply_chat_template(plain), add_special_tokens=False)


def test_a_content_part_whose_type_is_no_string_is_a_400(client: openai.OpenAI) -> None:
    """(The slow fuzz test found it: a list as a part's type made the lookup of text parts raise, a 500.)"""
    parts = [{"type": "text", "text": "Hi"}, {"type": [], "text": "Now"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=1)
    assert e.value.body["param"] == "messages.0.content.1"


def test_streamed_chat_concatenates_to_the_unstreamed_text(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=24, temperature=0
    )
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert sum(1 for p in parts if p) > 3  # the text as it is made (the unstreamed one is decoded at its end alone)
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client: openai.OpenAI, route: str) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk carries the usage so far,
    its tokens growing to the last chunk's whole usage, which is the unstreamed response's. It was ignored: only the
    last chunk had any."""
    if route == "chat":
        create: Any = client.chat.completions.create
        ask: dict[str, Any] = {"messages": [{"role": "user", "content": "Tell me about the sea."}]}
    else:
        create, ask = client.completions.create, {"prompt": "The sea is"}
    ask |= {"model": MODEL, "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = create(**ask).usage
    running = list(create(**ask, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in running) and _counts(running[-1].usage) == _counts(whole)
    so_far = [c.usage for c in running[:-1]]
    assert {(u.prompt_tokens, u.total_tokens - u.completion_tokens) for u in so_far} == {(whole.prompt_tokens,) * 2}
    counts = [u.completion_tokens for u in so_far]
    assert counts == sorted(counts) and counts[-1] == whole.completion_tokens and len(set(counts)) > 5
    if route == "chat":
        assert counts[0] == 0  # (the role's chunk, before any token)
    plain = list(create(**ask, stream=True, stream_options={"include_usage": True}))
    assert [c.usage for c in plain[:-1]] == [None] * (len(plain) - 1) and _counts(plain[-1].usage) == _counts(whole)


def _counts(usage: Any) -> tuple[int, int, int]:
    """A usage's token counts (its cached tokens left out: a repeated prompt finds its blocks cached)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_a_response_not_streamed_takes_its_text_at_the_end() -> None:
    """Its text is read once it is done: the engine decodes it then, once (``FINAL_ONLY``); a stream's comes as it is
    made (``DELTA``)."""
    messages = [{"role": "user", "content": "Hi"}]
    for stream, kind in ((False, RequestOutputKind.FINAL_ONLY), (True, RequestOutputKind.DELTA)):
        chat = ChatCompletionRequest(model=MODEL, messages=messages, stream=stream)
        completion = CompletionRequest(model=MODEL, prompt="Hi", stream=stream)
        assert sampling_params(chat, 8, None, None).output_kind is kind
        assert sampling_params(completion, 8, None, None).output_kind is kind


def test_completions_and_streaming(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    stream = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text
    assert whole.usage.completion_tokens <= 12 and whole.object == "text_completion"


def test_n_stop_and_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a poem."}], n=3, temperature=1.0, seed=7, max_tokens=8
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # three samples, not one copied
    assert 3 <= r.usage.completion_tokens <= 24
    free = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0)
    stop = free.choices[0].text.strip()[:2]
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free.choices[0].text[: free.choices[0].text.index(stop)]
    # vLLM's stop_reason: the stop string that ended it, streamed (on the last chunk) and not, on both routes.
    assert stopped.choices[0].model_extra["stop_reason"] == stop and free.choices[0].model_extra["stop_reason"] is None
    ask = {"model": MODEL, "max_tokens": 16, "temperature": 0, "stop": [stop], "stream": True}
    last = list(client.completions.create(prompt="1, 2, 3, 4,", **ask))[-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Count: 1, 2, 3"}], **ask)
    last_chat = [c for c in chat if c.choices][-1].choices[0]
    assert last_chat.model_extra["stop_reason"] in (stop, None)  # (the stop string, unless the answer ended first)
    lp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy: the top token
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob >= token.top_logprobs[2].logprob
    cl = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    assert len(cl.choices[0].logprobs.tokens) == 3 and all(len(t) <= 2 for t in cl.choices[0].logprobs.top_logprobs)


def _completion_logprobs(client: openai.OpenAI, **ask: Any) -> tuple[str, dict[str, list], dict[str, list]]:
    """A completion's text and its choice's ``logprobs``, unstreamed and streamed (the chunks' put together)."""
    whole = client.completions.create(**ask).choices[0]
    parts = [c.choices[0] for c in client.completions.create(**ask, stream=True) if c.choices]
    # Every chunk says something: text, tokens or the end (a delta whose tokens are held back makes none).
    assert all(p.text or (p.logprobs and p.logprobs.tokens) or p.finish_reason for p in parts)
    chunks = [p.logprobs for p in parts if p.logprobs]
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    streamed = {key: [v for part in chunks for v in getattr(part, key)] for key in keys}
    return whole.text, {key: getattr(whole.logprobs, key) for key in keys}, streamed


def test_chat_logprobs_bytes_are_each_tokens_own(client: openai.OpenAI) -> None:
    """A token that holds part of a character decodes to U+FFFD (its ``token``, as vLLM's), but its ``bytes`` are its
    own, as OpenAI's: the content's tokens' bytes joined are the content, streamed or not, and an alternative's are
    its own too. Before, such a token's bytes were U+FFFD's ([239, 191, 189]): no client could rebuild the text."""
    answer = "日本 😀"  # (SmolLM2 spells these characters over several tokens)
    ask: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi in Japanese with an emoji."}],
        "max_tokens": 20,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"structured_outputs": {"regex": answer}},
    }
    choice = client.chat.completions.create(**ask).choices[0]
    content = choice.logprobs.content
    assert choice.message.content == answer and any(t.token == "\ufffd" for t in content)
    end = [t.token for t in content].index("<|im_end|>")  # (the end token's logprob is listed too)
    assert bytes(b for t in content[:end] for b in t.bytes).decode() == answer
    alternatives = [alt for t in content for alt in t.top_logprobs]
    parts = [alt for alt in alternatives if alt.token.endswith("\ufffd")]
    assert parts and all(alt.bytes != list("\ufffd".encode()) for alt in parts)
    assert all(bytes(alt.bytes).decode() == alt.token for alt in alternatives if alt not in parts)
    streamed = []
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content or []
    assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in content]


def test_completion_top_logprobs_hold_the_sampled_token(client: openai.OpenAI) -> None:
    """OpenAI's legacy ``logprobs``: "The API will always return the logprob of the sampled token, so there may be up
    to logprobs+1 elements in the response" (vLLM's too): tokens sampled at a high temperature, not always the most
    likely, are among their ``top_logprobs``, as are the echoed prompt's; streamed and not."""
    ask = dict(model=MODEL, prompt="Once upon a time", max_tokens=4, logprobs=1, temperature=1.5, seed=5, echo=True)
    _, whole, streamed = _completion_logprobs(client, **ask)
    for lp in (whole, streamed):
        scored = list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True))[1:]
        assert all(top[token] == pytest.approx(logprob) and len(top) <= 2 for token, logprob, top in scored)
        assert any(len(top) == 2 for _, _, top in scored[-4:])  # a sampled token that was not the most likely
    assert streamed == whole


@pytest.mark.parametrize(
    ("prompt", "echo", "said", "stop"),
    [
        ("Emoji:", False, "🦜 ok", None),  # tokens that split a character
        ("I love 🦜 so!", True, " Yes.", None),  # the echoed prompt's, then the generated text's
        ("Count:", False, " one two three", ["two t"]),  # a stop string cuts the text short of its tokens
    ],
)
def test_completion_text_offsets_are_where_tokens_start(
    client: openai.OpenAI, prompt: str, echo: bool, said: str, stop: list[str] | None
) -> None:
    """A token's ``text_offset`` is the length of the choice's text decoded up to the token before it (the text a
    client has when it arrives; the echoed prompt's first, then the generated text's from the echo's end): they never
    decrease or pass the text, each whole token is found at its own, and a stream's are the unstreamed response's."""
    extra = {"structured_outputs": {"choice": [said]}}
    ask = dict(model=MODEL, prompt=prompt, echo=echo, stop=stop, max_tokens=16, logprobs=0, temperature=0)
    text, whole, streamed = _completion_logprobs(client, **ask, extra_body=extra)
    assert text == (prompt if echo else "") + (said[: said.index(stop[0])] if stop else said)
    offsets = whole["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] <= len(text) and streamed == whole
    for token, at in zip(whole["tokens"], offsets, strict=True):
        if "\ufffd" not in token and at + len(token) <= len(text):  # (not part of a character, nor past the text)
            assert text[at : at + len(token)] == token
    pieces = [at for token, at in zip(whole["tokens"], offsets, strict=True) if "\ufffd" in token]
    assert len(pieces) > 1 and len(set(pieces)) == 1 if "🦜" in text else not pieces  # all where the character starts


def _offline_scores(smollm2: LoadedModel, prompt: list[int], top_k: int) -> tuple[list, list]:
    """The offline engine's logprob of each token of ``prompt`` (None for the first) and of its first greedy token
    (``top_k`` alternatives asked for each): each token's own ``Logprob``."""
    offline = LLM.from_config(engine_config(MODEL, max_model_len=MAX_LEN, kv_cache_gb=0.25), smollm2)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=top_k, prompt_logprobs=top_k)
    out = offline.generate([prompt], params)[0]
    completion = out.outputs[0]
    assert out.prompt_logprobs is not None and completion.logprobs is not None
    scored = [None if p is None else p[t] for p, t in zip(out.prompt_logprobs, prompt, strict=True)]
    return scored, [p[t] for p, t in zip(completion.logprobs, completion.token_ids, strict=True)]


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client: openai.OpenAI, smollm2: LoadedModel) -> None:
    """lm-eval-harness's loglikelihood request (context + continuation, echo, logprobs 1, max_tokens 1, greedy): the
    prompt's tokens come first in ``logprobs`` (the first with None), scored as the offline engine scores them, text
    offsets counted from the echoed text; streamed the same; ``max_tokens: 0`` echoes the prompt alone."""
    text = "The capital of France is Paris"
    ids = smollm2.tokenizer.encode(text)
    ask = dict(model=MODEL, prompt=text, echo=True, logprobs=1, max_tokens=1, temperature=0)
    whole = client.completions.create(**ask)
    choice, lp = whole.choices[0], whole.choices[0].logprobs
    echo = smollm2.tokenizer.decode(ids)
    assert choice.text.startswith(echo) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    scored, generated = _offline_scores(smollm2, ids, 1)
    expected = [t.logprob for t in scored[1:]] + [generated[0].logprob]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    # Each token's alternatives: the most likely one, and the token itself when it is not that one (OpenAI's "up to
    # logprobs+1"), as vLLM's.
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top[token] == pytest.approx(logprob) and 1 <= len(top) <= 2
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] == len(echo)
    # What lm-eval reads: the continuation's logprob, and whether it is greedy (each token its position's top one).
    continuation = sum(lp.token_logprobs[len(ids) - 1 : -1])
    assert continuation == pytest.approx(scored[-1].logprob, abs=1e-4)
    stream = list(client.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].text for c in stream) == choice.text
    streamed = [c.choices[0].logprobs for c in stream if c.choices[0].logprobs is not None]
    assert [t for part in streamed for t in part.tokens] == lp.tokens
    assert [v for part in streamed for v in part.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [o for part in streamed for o in part.text_offset] == lp.text_offset
    for stream_it in (False, True):
        alone = client.completions.create(**{**ask, "max_tokens": 0}, stream=stream_it)
        chunks = list(alone) if stream_it else [alone]
        assert "".join(c.choices[0].text for c in chunks) == echo
        tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert len(tokens) == len(ids) and chunks[-1].choices[0].finish_reason == "length"
    unstreamed = client.completions.create(**{**ask, "max_tokens": 0})
    assert unstreamed.usage.completion_tokens == 0 and unstreamed.usage.prompt_tokens == len(ids)


def test_a_prompt_that_fills_the_context_is_echoed_alone_and_one_past_it_is_named(
    client: openai.OpenAI, smollm2: LoadedModel
) -> None:
    """``echo`` with ``max_tokens`` 0 scores a prompt of exactly the context's length (lm-eval's loglikelihood of a
    context cut to the model's length): nothing is generated, so nothing needs room (it was a 400, "1 more were
    requested"). A generated token still needs room; a prompt longer than the context alone is refused naming
    ``prompt`` on completions (it named ``max_tokens``), ``messages`` on chat (OpenAI's name for chat's prompt)."""
    ids = smollm2.tokenizer.encode("The sea is calm tonight, and the tide is full. " * 120)[:MAX_LEN]
    assert len(ids) == MAX_LEN
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (MAX_LEN, 0)
    assert choice.text == smollm2.tokenizer.decode(ids) and len(choice.logprobs.tokens) == MAX_LEN
    assert choice.logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    refused = [
        (lambda: client.completions.create(model=MODEL, prompt=ids, max_tokens=1), "max_tokens"),
        (lambda: client.completions.create(model=MODEL, prompt=[*ids, ids[0]]), "prompt"),
        (lambda: client.completions.create(model=MODEL, prompt=[*ids, ids[0]], max_tokens=0, echo=True), "prompt"),
        (
            lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x " * 2000}]),
            "messages",
        ),
    ]
    for ask, param in refused:
        with pytest.raises(openai.BadRequestError) as e:
            ask()
        assert e.value.body["param"] == param and "maximum context length is 1024" in e.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_the_context_is_refused_with_openais_code(client: openai.OpenAI, stream: bool) -> None:
    """A prompt too long for the context, or one whose answer asked for would not fit, is a 400 with OpenAI's code
    ``context_length_exceeded`` on every route (agents read the code, not the message, to compact their history and
    retry; it was ``invalid_value``), naming the field the client sent: ``messages`` on chat (it named ``prompt``, a
    field chat has not), ``max_completion_tokens`` or ``max_tokens`` where the prompt fits but the answer asked for
    does not, ``input`` and ``max_output_tokens`` on the Responses API."""
    fits = [{"role": "user", "content": "x " * 400}]  # (about 400 tokens of 1024)
    too_long = [{"role": "user", "content": "x " * 2000}]
    chat, completions, responses = client.chat.completions, client.completions, client.responses
    refused = [
        (lambda: chat.create(model=MODEL, messages=too_long, max_tokens=4, stream=stream), "messages"),
        (
            lambda: chat.create(model=MODEL, messages=fits, max_completion_tokens=900, stream=stream),
            "max_completion_tokens",
        ),
        (lambda: chat.create(model=MODEL, messages=fits, max_tokens=900, stream=stream), "max_tokens"),
        (lambda: completions.create(model=MODEL, prompt="x " * 2000, max_tokens=4, stream=stream), "prompt"),
        (lambda: completions.create(model=MODEL, prompt="x " * 400, max_tokens=900, stream=stream), "max_tokens"),
        (lambda: responses.create(model=MODEL, input="x " * 2000, max_output_tokens=16, stream=stream), "input"),
        (
            lambda: responses.create(model=MODEL, input="x " * 400, max_output_tokens=900, stream=stream),
            "max_output_tokens",
        ),
    ]
    for ask, param in refused:
        with pytest.raises(openai.BadRequestError) as e:
            ask()
        error = e.value.body
        assert (error["param"], error["code"], error["type"]) == (
            param,
            "context_length_exceeded",
            "invalid_request_error",
        )
        assert "maximum context length is 1024" in error["message"]
    _good_request(client)


def test_prompt_logprobs_on_chat_and_completions_have_vllms_shape(client: openai.OpenAI, smollm2: LoadedModel) -> None:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) a map from token id to its logprob, rank and
    text, the prompt's token and its top alternatives; beside the choices for chat, in each choice for completions."""
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    tok = smollm2.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    completion = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    scored, _ = _offline_scores(smollm2, ids, 2)
    for served in (chat.model_extra["prompt_logprobs"], completion.choices[0].model_extra["prompt_logprobs"]):
        assert len(served) == len(ids) and served[0] is None
        for token, entry, offline in zip(ids[1:], served[1:], scored[1:], strict=True):
            mine = entry[str(token)]
            assert mine["logprob"] == pytest.approx(offline.logprob, abs=1e-4) and mine["rank"] == offline.rank
            assert mine["decoded_token"] == tok.decode([token], skip_special_tokens=False)
            assert len(entry) <= 3 and {e["rank"] for k, e in entry.items() if k != str(token)} <= {1, 2}
    assert completion.choices[0].logprobs is None  # (no echo: the choice's own logprobs are not asked for)


@pytest.mark.slow  # (4 s; the sampler's parity with transformers, tests/model, and the fields' checks stay fast)
def test_penalties_and_logit_bias_are_served_as_the_offline_engine_applies_them(
    client: openai.OpenAI, smollm2: LoadedModel
) -> None:
    prompt = "a a a a a a a a a a a a a a a a"
    forced = smollm2.tokenizer.encode(" banana")[0]
    asks = [
        {},
        {"frequency_penalty": 2.0},
        {"presence_penalty": 1.5, "extra_body": {"repetition_penalty": 1.3}},
        {"logit_bias": {str(forced): 100}},
    ]
    served = [
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, **ask).choices[0].text
        for ask in asks
    ]
    offline = LLM.from_config(engine_config(MODEL, max_model_len=MAX_LEN, kv_cache_gb=0.25), smollm2)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=2.0),
        SamplingParams(temperature=0.0, max_tokens=12, presence_penalty=1.5, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=12, logit_bias={forced: 100.0}),
    ]
    expected = [offline.generate([prompt], p)[0].outputs[0].text for p in params]
    assert served == expected
    assert len(set(served[:3])) == 3  # each penalty changed the greedy text
    assert served[3] == smollm2.tokenizer.decode([forced] * 12)


def test_response_format_and_structured_outputs_hold_outputs_to_grammars(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a large city and its population."}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    }
    whole = client.chat.completions.create(**ask)
    value = json.loads(whole.choices[0].message.content)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    assert whole.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(**ask, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.choices[0].message.content
    # JSON mode: an object, where the free answer is prose.
    free = client.chat.completions.create(**{**ask, "response_format": {"type": "text"}})
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)
    mode = client.chat.completions.create(**{**ask, "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(mode.choices[0].message.content), dict)
    # vLLM's structured_outputs: a choice.
    pick = client.completions.create(
        model=MODEL,
        prompt="Review: the food was wonderful. Sentiment:",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["positive", "negative"]}},
    )
    assert pick.choices[0].text in ("positive", "negative") and pick.choices[0].finish_reason == "stop"


def test_tool_choice_required_gets_calls_of_the_tools(client: openai.OpenAI) -> None:
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[weather],
        tool_choice="required",
        max_tokens=60,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)


@pytest.mark.parametrize("max_tokens", [25, 44])
def test_forced_calls_cut_off_by_max_tokens_come_as_far_as_they_got(client: openai.OpenAI, max_tokens: int) -> None:
    """A forced call cut off by max_tokens: the calls as far as they were written (a whole first one, the last one's
    arguments so far), no content, finish_reason length; streamed the same. Before, the unstreamed response had the
    raw JSON as content and no call, while the stream sent the calls and then that text again as content (and
    Anthropic's client built a tool_use the unstreamed message lacked)."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Call get_weather for Tokyo and Berlin."}],
        "tools": [weather],
        "tool_choice": "required",
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None and whole.message.tool_calls
    content, finish, calls = streamed_chat(client, ask)
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == calls
    assert (content, finish) == ("", "length")


def test_async_client_32_concurrent_streams_match_offline(aclient: openai.AsyncOpenAI, smollm2: LoadedModel) -> None:
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(32)]

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    served = asyncio.run(all_of_them())
    offline = LLM.from_config(engine_config(MODEL, max_model_len=MAX_LEN, kv_cache_gb=0.25), smollm2)
    expected = [r.outputs[0].text for r in offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))]
    assert served == expected


def test_disconnect_mid_stream_frees_blocks(server: ServerThread, engine: AsyncEngine) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert engine.stats()["0"].kv_blocks_used > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (engine.stats()["0"].kv_blocks_used or engine.stats()["0"].num_running):
        time.sleep(0.05)
    assert engine.stats()["0"].kv_blocks_used == 0 and engine.stats()["0"].num_running == 0
    metrics = httpx.get(server.url + "/metrics").text
    assert 'boundless_kv_blocks_used{instance="0"} 0.0' in metrics
    # The request its client gave up on is counted as vLLM counts one (it was missing from the finished requests).
    assert 'boundless_requests_finished_total{finish_reason="abort",instance="0"}' in metrics


def test_metrics_expose_engine_and_latency_series(server: ServerThread, client: openai.OpenAI) -> None:
    _good_request(client)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "boundless_num_requests_running",
        "boundless_num_requests_waiting",
        "boundless_kv_blocks_used",
        "boundless_prefix_cache_hit_rate",
        "boundless_prompt_tokens_total",
        "boundless_generation_tokens_total",
        "boundless_time_to_first_token_seconds_bucket",
        "boundless_time_per_output_token_seconds_bucket",
        "boundless_e2e_request_latency_seconds_count",
        "boundless_kv_window_blocks_released_total",
    ):
        assert name in text, name


def _gauge(server: ServerThread, name: str) -> float:
    line = next(x for x in httpx.get(server.url + "/metrics").text.splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_metrics_count_the_programs_tracked_and_those_with_calls_in_the_engine(
    server: ServerThread, client: openai.OpenAI
) -> None:
    # What an operator of agents checks the scheduler by: that its calls group into programs, and that the table
    # stays bounded (tests/programs/test_process_table.py has its expiry and cap).
    tracked = _gauge(server, "boundless_programs_tracked")
    for program in ("metrics-a", "metrics-b", "metrics-a"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"program_id": program}
        )
    assert _gauge(server, "boundless_programs_tracked") == tracked + 2
    assert _gauge(server, "boundless_programs_with_calls") == 0
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=200, stream=True,
        extra_body={"program_id": "metrics-c", "ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))
    try:
        assert _gauge(server, "boundless_programs_with_calls") == 1
    finally:
        stream.close()


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": 3.0}, "temperature"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"max_tokens": MAX_LEN}, "max_tokens"),
    ],
)
def test_invalid_values_get_400(client: openai.OpenAI, change: dict, param: str) -> None:
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **change}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kwargs)
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    _good_request(client)


def test_unknown_model_gets_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["code"] == "model_not_found"
    _good_request(client)


def test_an_unexpected_error_is_a_500_object_and_the_connection_stays_open(
    server: ServerThread, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_submit = engine.submit
    calls = 0

    def submit_failing_once(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected failure")
        return real_submit(*args, **kwargs)

    monkeypatch.setattr(engine, "submit", submit_failing_once)
    ports: list[int] = []  # the client's end of each response's connection

    def note_port(response: httpx.Response) -> None:
        ports.append(response.extensions["network_stream"].get_extra_info("client_addr")[1])

    http = httpx.Client(event_hooks={"response": [note_port]})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, http_client=http)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert e.value.status_code == 500
    assert e.value.body["type"] == "server_error" and "RuntimeError" in e.value.body["message"]
    assert any("injected failure" in r.exc_text for r in caplog.records if r.exc_text)  # the traceback is logged
    _good_request(client)
    assert len(ports) == 2 and ports[0] == ports[1]  # the second call went over the first one's connection
    http.close()


def test_malformed_json_and_oversized_body(server: ServerThread, client: openai.OpenAI) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": "not a list", "model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    big = b'{"model": "x", "prompt": "' + b"a" * (9 << 20) + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    _good_request(client)


def test_full_waiting_queue_gets_429_with_retry_after(tiny_llama: LoadedModel) -> None:
    eng = _engine(tiny_llama, max_waiting=2, max_num_seqs=1, max_model_len=512)
    srv = start_in_thread(eng, "tiny")
    try:

        async def burst() -> list[httpx.Response]:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 300, "ignore_eos": True}
            async with httpx.AsyncClient(timeout=60) as http:
                return await asyncio.gather(*(http.post(srv.url + "/v1/completions", json=body) for _ in range(6)))

        responses = asyncio.run(burst())
        statuses = sorted(r.status_code for r in responses)
        assert 429 in statuses and 200 in statuses
        busy = next(r for r in responses if r.status_code == 429)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "rate_limit_error"
        ok = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
        # More samples than may ever wait: a 400 that says why, not a 429 at every retry of an idle server.
        for body in ({"prompt": "hi", "n": 3}, {"prompt": ["a", "b", "c"]}):
            too_many = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "max_tokens": 2, **body})
            assert too_many.status_code == 400 and "--max-waiting" in too_many.json()["error"]["message"]
        two = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 2})
        assert two.status_code == 200 and len(two.json()["choices"]) == 2
    finally:
        srv.stop()
        eng.shutdown()


def test_api_key_guards_every_route_but_health(tiny_llama: LoadedModel) -> None:
    eng = _engine(tiny_llama, max_model_len=512)
    srv = start_in_thread(eng, "tiny", ServerConfig(api_key="sekret"))
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    finally:
        srv.stop()
        eng.shutdown()


def test_a_model_served_under_several_names_answers_to_each(tiny_llama: LoadedModel) -> None:
    # vLLM's --served-model-name takes several names; here the second stopped the command line (first as
    # "unrecognized arguments", then taken for the model). Any name is served; /v1/models lists each.
    eng = _engine(tiny_llama, max_model_len=512)
    srv = start_in_thread(eng, "tiny", ServerConfig(served_model_name=("tiny", "tiny-alias")))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
        assert client.models.retrieve("tiny-alias").id == "tiny-alias"
        for name in ("tiny", "tiny-alias"):
            assert client.completions.create(model=name, prompt="hi", max_tokens=2).choices
        with pytest.raises(openai.NotFoundError, match="serves 'tiny', 'tiny-alias'"):
            client.completions.create(model="other", prompt="hi", max_tokens=2)
    finally:
        srv.stop()
        eng.shutdown()


class RefuseWaiting:
    """Step hooks in a lending agent's place (``LendingAgent.refuse``): every request still waiting before the next
    schedule is failed as the gManager fails one that the live instances cannot hold."""

    def __init__(self, core: EngineCore, stop_reason: str | None = GRANT_REFUSED) -> None:
        self.core, self.stop_reason = core, stop_reason

    def between_steps(self) -> list[RequestDelta]:
        waiting = [r.request_id for r in self.core.scheduler.waiting]
        return [
            RequestDelta(rid, [], "", [], finished=True, finish_reason="error", stop_reason=self.stop_reason)
            for rid in waiting
            if self.core.abort(rid)
        ]

    def step_failed(self, error: Exception, sched) -> bool:
        return False


def test_a_request_the_cluster_cannot_hold_is_a_503_with_retry_after_and_the_server_serves_on(
    server: ServerThread, engine: AsyncEngine, client: openai.OpenAI
) -> None:
    raw = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    # Unstreamed and streamed (a streamed request's 200 waits for its first delta), chat and completions, n = 1 and 2.
    calls = [
        lambda: raw.chat.completions.create(model=MODEL, messages=messages, max_tokens=3),
        lambda: list(raw.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True)),
        lambda: list(raw.completions.create(model=MODEL, prompt="Hi", max_tokens=3, n=2, stream=True)),
    ]
    for call in calls:
        with engine.lock:
            engine.hooks = RefuseWaiting(engine.core)
        try:
            with pytest.raises(openai.APIStatusError) as e:
                call()
        finally:
            with engine.lock:
                engine.hooks = None
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "10"
        assert e.value.body["code"] == "kv_capacity_unavailable" and e.value.body["message"] == GRANT_REFUSED
        assert not engine.core.has_unfinished()
        _good_request(client)
    # Any other failure before the first token is the unstreamed 500 too.
    with engine.lock:
        engine.hooks = RefuseWaiting(engine.core, stop_reason=None)
    try:
        with pytest.raises(openai.InternalServerError) as failed:
            list(raw.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True))
    finally:
        with engine.lock:
            engine.hooks = None
    assert failed.value.body["code"] == "engine_error"
    _good_request(client)


def test_predicted_outputs_give_the_same_answer_and_count_the_drafts(client: openai.OpenAI) -> None:
    """OpenAI's ``prediction``: the answer is the one without it (greedy), streamed or not, and the usage counts the
    prediction's drafts the answer kept and rejected; a prediction that is the answer keeps most of it."""
    asked = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "List the days of the week, one per line."}],
        "max_tokens": 40,
        "temperature": 0,
    }
    plain = client.chat.completions.create(**asked)
    answer = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # (no prediction, no reasoning: nothing to detail)
    right = client.chat.completions.create(**asked, prediction={"type": "content", "content": answer})
    assert right.choices[0].message.content == answer
    details = right.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= plain.usage.completion_tokens // 2
    parts = [{"type": "text", "text": answer[:10]}, {"type": "text", "text": "Caturday" + answer[18:]}]
    edited = client.chat.completions.create(
        **asked, prediction={"type": "content", "content": parts}, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(edited)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    usage = chunks[-1].usage.completion_tokens_details
    assert usage.accepted_prediction_tokens > 0 and usage.rejected_prediction_tokens > 0


@pytest.mark.parametrize(
    "prediction",
    [{"type": "text", "content": "x"}, {"type": "content"}, {"type": "content", "content": [{"type": "image"}]}, "x"],
)
def test_a_prediction_that_is_not_openais_shape_is_a_400(server: ServerThread, prediction: object) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prediction": prediction}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prediction"), r.text


def test_continue_final_message_continues_the_assistants_text(server: ServerThread, client: openai.OpenAI) -> None:
    """vLLM's ``continue_final_message``: the prompt ends at the last (assistant) message's text, its turn left open,
    and the answer goes on from it: the completion of that very prompt. With ``add_generation_prompt`` left on, a
    400."""
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    asked = {"add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages, **asked}, timeout=60).json()["tokens"]
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=asked
    )
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == plain.choices[0].text and reply.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as both:
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body={"continue_final_message": True}
        )
    assert both.value.body["param"] == "continue_final_message"


def test_cached_tokens_of_n_samples_are_the_prompts_not_a_siblings(tiny_llama: LoadedModel) -> None:
    """With ``n`` > 1, the prompt's cached tokens are those it found before the request (OpenAI's meaning): not the
    blocks one sample finds computed by another (a token budget of 32 admits the samples a chunk at a time, so the
    second finds the first's)."""
    eng = _engine(tiny_llama, max_model_len=512, max_num_batched_tokens=32)
    srv = start_in_thread(eng, "tiny")
    try:
        body = {"model": "tiny", "prompt": list(range(10, 110)), "max_tokens": 2, "n": 2}
        first = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # now the prompt's own (6 full blocks)
    finally:
        srv.stop()
        eng.shutdown()


def test_truncate_prompt_tokens_keeps_the_prompts_end(client: openai.OpenAI, smollm2: LoadedModel) -> None:
    """vLLM's truncate_prompt_tokens: the prompt's last tokens, as if they had been sent alone; -1 the context's length;
    0 or more than the context a 400."""
    text = "one two three four five six seven eight nine ten"
    ids = smollm2.tokenizer.encode(text)
    alone = client.completions.create(model=MODEL, prompt=ids[-4:], max_tokens=6, temperature=0)
    cut = client.completions.create(
        model=MODEL, prompt=text, max_tokens=6, temperature=0, extra_body={"truncate_prompt_tokens": 4}
    )
    assert cut.usage is not None and cut.usage.prompt_tokens == 4
    assert cut.choices[0].text == alone.choices[0].text
    whole = client.completions.create(model=MODEL, prompt=text, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 5
    for keep in (0, 10**6):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(
                model=MODEL, prompt=text, max_tokens=1, extra_body={"truncate_prompt_tokens": keep}
            )
        assert err.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]
