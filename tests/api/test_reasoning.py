"""A reasoning model's thinking apart from its answer (``--reasoning-parser``): the parsers on their own, streamed in
every chunking, and served: a random model held by a grammar to write ``<think>...</think>`` and then an answer or a
tool call, read through the real `openai` client, streamed and not, with a Qwen3-style template that takes
``enable_thinking`` and ``reasoning_effort``."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from served_models import Served, serve_hermes

from boundless.api.reasoning import ReasoningOutput, ReasoningParser, ReasoningStream, Split
from boundless.config import ServerConfig

QWEN3 = ReasoningParser.named("qwen3")
R1 = ReasoningParser.named("deepseek_r1")
GLM45 = ReasoningParser.named("glm45")


@pytest.mark.parametrize(
    ("parser", "opened", "text", "expected"),
    [
        (QWEN3, False, "<think>\nfirst a, then b\n</think>\n\nAnswer.", Split("\nfirst a, then b\n", "\n\nAnswer.")),
        (QWEN3, False, "  <think>x</think>y", Split("x", "y")),  # blanks before the tag
        (QWEN3, False, "No thinking here.", Split(None, "No thinking here.")),  # enable_thinking off
        (QWEN3, False, "An answer that mentions <think> later.", Split(None, "An answer that mentions <think> later.")),
        (QWEN3, False, "<think>cut off before the end", Split("cut off before the end", None)),
        (QWEN3, True, "the prompt opened it</think>answer", Split("the prompt opened it", "answer")),
        (QWEN3, False, "<think></think>", Split("", None)),
        (R1, True, "R1 never writes the start tag</think>answer", Split("R1 never writes the start tag", "answer")),
        (R1, True, "<think>R1-0528 does</think>answer", Split("R1-0528 does", "answer")),
        (R1, True, "still thinking", Split("still thinking", None)),
        (R1, True, "a</think>b</think>c", Split("a", "b</think>c")),  # the first end tag ends it
        (R1, False, "the prompt closed the thinking", Split(None, "the prompt closed the thinking")),
        # GLM-4.5 and GLM-4.6 write the start tag after their template's <|assistant|>, a line before it.
        (GLM45, False, "\n<think>Paris, then</think>\nSunny.", Split("Paris, then", "\nSunny.")),
        (GLM45, False, "\n<think>still thinking", Split("still thinking", None)),
        # An output that does not open with it is the answer (vLLM's glm45 now reads it as R1's would: reasoning).
        (GLM45, False, "Sunny.</think>", Split(None, "Sunny.</think>")),
        (GLM45, True, "GLM-4.7's template opens it</think>Sunny.", Split("GLM-4.7's template opens it", "Sunny.")),
    ],
)
def test_split(parser: ReasoningParser, opened: bool, text: str, expected: Split) -> None:
    assert parser.split(text, opened) == expected


def test_where_an_output_starts() -> None:
    assert QWEN3.opens_in_reasoning("<|im_start|>assistant\n<think>\n")  # a thinking-only model's template
    assert not QWEN3.opens_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking turned off
    assert not QWEN3.opens_in_reasoning("<|im_start|>assistant\n")
    assert R1.opens_in_reasoning("<|im_start|>assistant\n")
    assert not R1.opens_in_reasoning("<|Assistant|><think>\n\n</think>\n\n")  # closed by the prompt
    # GLM-4.5's and GLM-4.6's template: the model opens the thinking itself; enable_thinking false closes an empty
    # block in the prompt; GLM-4.7's opens it.
    assert not GLM45.opens_in_reasoning("<|user|>\nWeather?<|assistant|>")
    assert GLM45.closed_in("<|user|>\nWeather?/nothink<|assistant|>\n<think></think>")
    assert not GLM45.opens_in_reasoning("<|user|>\nWeather?/nothink<|assistant|>\n<think></think>")
    assert GLM45.opens_in_reasoning("<|user|>\nWeather?<|assistant|><think>")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningParser.named("granite")


TEXTS = [
    "<think>\nfirst a, then b\n</think>\n\nThe answer.",
    "  <think>x</think>y",
    "No thinking here.",
    "<thin> is not the tag",
    "<think>cut off </thi",
    "a</think>b</think>c",
    "\n<think>GLM's</think>\nSure.\n<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
    "</think>",
    "",
    " \n ",
]


@pytest.mark.parametrize("parser", [QWEN3, R1, GLM45], ids=["qwen3", "deepseek_r1", "glm45"])
@pytest.mark.parametrize("opened", [False, True])
def test_a_stream_sends_what_the_whole_output_splits_into(parser: ReasoningParser, opened: bool) -> None:
    """In every chunking (pieces of 1 to 4 characters, 30 random ones per text), the pieces sent add up to the split
    of the whole text, and nothing sent is taken back (a tag's start is held until it is known to be one)."""
    rng = random.Random(0)
    for text in TEXTS:
        split = parser.split(text, opened)
        for _ in range(30):
            stream, reasoning, content, at = ReasoningStream(parser, opened), "", "", 0
            while at < len(text):
                at = min(len(text), at + rng.randint(1, 4))
                new_reasoning, new_content = stream.feed(text[:at])
                reasoning, content = reasoning + new_reasoning, content + new_content
            new_reasoning, new_content = stream.feed(text, final=True)
            reasoning, content = reasoning + new_reasoning, content + new_content
            assert (reasoning, content or None) == (split.reasoning or "", split.content), text


def test_reasoning_tokens_end_with_the_end_tag() -> None:
    def decode(ids: Any) -> str:  # a token per character
        return "".join(map(chr, ids))

    def tokens(text: str, opened: bool = False) -> int:
        return ReasoningOutput(QWEN3, opened).tokens([ord(ch) for ch in text], decode)

    assert tokens("<think>ab</think>cd") == len("<think>ab</think>")
    assert tokens("<think>cut off") == len("<think>cut off")
    assert tokens("no reasoning") == 0
    assert tokens("ab</think>cd", opened=True) == len("ab</think>")


# -- served ------------------------------------------------------------------------------------------------------------

# Hermes tool calls, a Qwen3-style generation prompt (thinking turned off closes an empty think block; a thinking-only
# model opens one), earlier turns' reasoning rendered, and reasoning_effort shown in a system line.
QWEN3_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\\neffort: {{ reasoning_effort }}<|im_end|>\\n{% endif %}"
    "{% if tools %}<|im_start|>system\\nTools:\\n"
    "{% for t in tools %}{{ t | tojson }}\\n{% endfor %}<|im_end|>\\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\\n\\n</think>\\n\\n{% endif %}"
    "{% if open_think is defined and open_think %}<think>\\n{% endif %}{% endif %}"
)

THINK_THEN_ANSWER = r"<think>[a-z ]{4,12}</think>[a-z ]{2,8}"
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
# WEATHER as the server hands it to the template (vLLM's way: an omitted description as null).
WEATHER_IN_TEMPLATE = [
    {"type": "function", "function": {"name": "get_weather", "description": None, "parameters": {"type": "object"}}}
]
THINK_THEN_CALL = (
    r'<think>[a-z ]{4,12}</think><tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'
)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve_hermes(
        tmp_path_factory.mktemp("reasoning"),
        QWEN3_TEMPLATE,
        ServerConfig(reasoning_parser="qwen3", structured_outputs_in_reasoning=True),
    ) as s:
        yield s


def _chat(served: Served, regex: str, **kwargs: Any) -> Any:
    extra = {"structured_outputs": {"regex": regex}, **kwargs.pop("extra_body", {})}
    return served.client.chat.completions.create(
        model="tiny",
        messages=kwargs.pop("messages", ASK),
        max_tokens=kwargs.pop("max_tokens", 120),
        temperature=0,
        extra_body=extra,
        **kwargs,
    )


def _streamed(served: Served, regex: str, **kwargs: Any) -> dict[str, Any]:
    """A streamed chat's pieces put together: reasoning, content, tool calls, the finish reason, the usage."""
    out: dict[str, Any] = {"reasoning": "", "reasoning_content": "", "content": "", "calls": {}, "finish": None}
    for chunk in _chat(served, regex, stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            for key in ("reasoning", "reasoning_content", "content"):
                out[key] += delta.get(key) or ""
            for call in delta.get("tool_calls") or ():
                entry = out["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call["function"].get("name") or ""
                entry["arguments"] += call["function"].get("arguments") or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def _text(served: Served, regex: str, **kwargs: Any) -> str:
    """What the model writes under ``regex`` with no reasoning parser's reading: the plain completion."""
    prompt = served.loaded.tokenizer.apply_chat_template(ASK, **kwargs)
    reply = httpx.post(
        served.url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 120, "temperature": 0,
              "structured_outputs": {"regex": regex}},
        timeout=60,
    )  # fmt: skip
    return reply.json()["choices"][0]["text"]


def test_reasoning_apart_from_the_answer(served: Served) -> None:
    text = _text(served, THINK_THEN_ANSWER)
    thought, answer = text.removeprefix("<think>").split("</think>")
    reply = _chat(served, THINK_THEN_ANSWER)
    message = reply.choices[0].message
    assert message.content == answer and message.reasoning == thought and message.reasoning_content == thought
    details = reply.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < reply.usage.completion_tokens
    # The tokens counted as reasoning are those up to the one that completes </think>.
    ids = served.loaded.tokenizer.encode(text, add_special_tokens=False)
    assert "</think>" in served.loaded.tokenizer.decode(ids[: details.reasoning_tokens])
    assert "</think>" not in served.loaded.tokenizer.decode(ids[: details.reasoning_tokens - 1])
    streamed = _streamed(served, THINK_THEN_ANSWER)
    assert streamed["reasoning"] == streamed["reasoning_content"] == thought
    assert streamed["content"] == answer and streamed["finish"] == reply.choices[0].finish_reason
    assert streamed["usage"].completion_tokens_details.reasoning_tokens == details.reasoning_tokens


@pytest.mark.parametrize("tools", [None, WEATHER], ids=["no tools", "tools"])
def test_chat_logprobs_are_the_answers_tokens(served: Served, tools: Any) -> None:
    """A chat message's logprobs are its content's tokens (OpenAI's "message content tokens"), not the reasoning's or
    its end tag's: streamed and not, they spell the answer and the EOS that ended it, read for calls or not."""
    kwargs: dict[str, Any] = {"logprobs": True} if tools is None else {"logprobs": True, "tools": tools}
    whole = _chat(served, THINK_THEN_ANSWER, **kwargs).choices[0]
    tokens = [t.token for t in whole.logprobs.content]
    assert "".join(tokens) == whole.message.content + "<|im_end|>" and whole.message.reasoning
    chunks = list(_chat(served, THINK_THEN_ANSWER, stream=True, **kwargs))
    assert [t.token for c in chunks for t in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])] == tokens


def test_a_tool_call_after_the_reasoning(served: Served) -> None:
    reply = _chat(served, THINK_THEN_CALL, tools=WEATHER)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'
    streamed = _streamed(served, THINK_THEN_CALL, tools=WEATHER)
    assert streamed["reasoning"] == choice.message.reasoning and streamed["content"] == ""
    assert streamed["calls"] == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert streamed["finish"] == "tool_calls"


def test_thinking_turned_off_and_on_by_the_template(served: Served) -> None:
    """``enable_thinking: false`` closes an empty think block in the prompt, so what the model writes is all answer;
    a template that opens the block makes the output start inside the reasoning, with no start tag written."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = _chat(served, "[a-z ]{4,12}", extra_body=off).choices[0].message
    assert plain.reasoning is None and plain.content == _text(served, "[a-z ]{4,12}", enable_thinking=False)
    # Without the kwarg the same words are still the answer (the output did not begin with <think>).
    assert _chat(served, "[a-z ]{4,12}").choices[0].message.reasoning is None
    opened = _chat(served, "[a-z ]{4,12}</think>[a-z ]{2,8}", extra_body={"chat_template_kwargs": {"open_think": True}})
    text = _text(served, "[a-z ]{4,12}</think>[a-z ]{2,8}", open_think=True)
    assert (opened.choices[0].message.reasoning, opened.choices[0].message.content) == tuple(text.split("</think>"))


def test_include_reasoning_false_drops_it(served: Served) -> None:
    message = _chat(served, THINK_THEN_ANSWER, extra_body={"include_reasoning": False}).choices[0].message
    assert message.model_dump().get("reasoning") is None and message.content
    assert "<think>" not in message.content
    streamed = _streamed(served, THINK_THEN_ANSWER, extra_body={"include_reasoning": False})
    assert streamed["reasoning"] == "" and streamed["content"] == message.content


def test_template_variables_reach_the_template(served: Served) -> None:
    def count(**body: Any) -> int:
        reply = httpx.post(served.url + "/tokenize", json={"messages": ASK, **body}, timeout=30)
        assert reply.status_code == 200, reply.text
        return reply.json()["count"]

    base = count()
    assert count(chat_template_kwargs={"enable_thinking": False}) > base
    # reasoning_effort reaches the template (a system line here), as the chat route's usage shows.
    effort = _chat(served, "[a-z ]{2,4}", reasoning_effort="high", max_tokens=4)
    assert effort.usage.prompt_tokens > _chat(served, "[a-z ]{2,4}", max_tokens=4).usage.prompt_tokens
    # An earlier turn's reasoning, sent back under either name, is rendered by a template that reads it.
    for key in ("reasoning_content", "reasoning"):
        turns = [*ASK, {"role": "assistant", "content": "Sunny.", key: "look it up"}, {"role": "user", "content": "?"}]
        without = [*ASK, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "?"}]
        assert count(messages=turns) > count(messages=without)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"namespace": 1}}, "chat_template_kwargs"),  # (a function templates call)
        ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ],
)
def test_bad_template_variables(served: Served, body: dict[str, Any], param: str) -> None:
    reply = httpx.post(served.url + "/v1/chat/completions", json={"model": "tiny", "messages": ASK, **body}, timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"].startswith(param)


# -- the Responses API ---------------------------------------------------------------------------------------------


def _respond(served: Served, regex: str, **kwargs: Any) -> Any:
    extra = {"structured_outputs": {"regex": regex}, **kwargs.pop("extra_body", {})}
    return served.client.responses.create(
        model="tiny", input=ASK[0]["content"], max_output_tokens=120, temperature=0, extra_body=extra, **kwargs
    )


def test_responses_put_the_reasoning_in_its_own_item(served: Served) -> None:
    thought, answer = _text(served, THINK_THEN_ANSWER).removeprefix("<think>").split("</think>")
    response = _respond(served, THINK_THEN_ANSWER)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == thought and reasoning.summary == []
    assert message.type == "message" and response.output_text == answer
    chat = _chat(served, THINK_THEN_ANSWER)
    thought_tokens = response.usage.output_tokens_details.reasoning_tokens
    assert 0 < thought_tokens < response.usage.output_tokens
    assert thought_tokens == chat.usage.completion_tokens_details.reasoning_tokens
    # reasoning.effort reaches the template, as chat's reasoning_effort does.
    effort = _respond(served, THINK_THEN_ANSWER, reasoning={"effort": "low"})
    assert effort.usage.input_tokens > response.usage.input_tokens and effort.output[0].type == "reasoning"
    # The next response of the chain sees this turn's reasoning (the template renders it): its prompt is the chat
    # form of the conversation with the reasoning in the assistant turn.
    follow = served.client.responses.create(
        model="tiny", input="And tomorrow?", previous_response_id=response.id, max_output_tokens=1
    )
    turns = [
        *ASK,
        {"role": "assistant", "content": answer, "reasoning_content": thought},
        {"role": "user", "content": "And tomorrow?"},
    ]
    counted = httpx.post(served.url + "/tokenize", json={"messages": turns}, timeout=30).json()["count"]
    assert follow.usage.input_tokens == counted


def test_responses_stream_the_reasoning_first(served: Served) -> None:
    logprobs = {"include": ["message.output_text.logprobs"]}
    whole = _respond(served, THINK_THEN_ANSWER, **logprobs)
    events = list(_respond(served, THINK_THEN_ANSWER, stream=True, **logprobs))
    kinds = [e.type for e in events]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert thought == whole.output[0].content[0].text and text == whole.output_text
    # The reasoning item (output 0) is opened, written and closed before the message (output 1) opens.
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [d.type for d in done] == ["reasoning", "message"] and done[0].content[0].text == thought
    final = events[-1].response
    assert kinds[-1] == "response.completed" and [o.type for o in final.output] == ["reasoning", "message"]
    # The message's logprobs are its own tokens', not the reasoning's: streamed and whole alike, they spell its text and
    # the EOS that ended it (whose logprob the last delta carries, with no text).
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == [lp.token for lp in whole.output[1].content[0].logprobs]
    assert "".join(streamed) == text + "<|im_end|>"


def test_responses_a_function_call_after_the_reasoning(served: Served) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    response = _respond(served, THINK_THEN_CALL, tools=tools)
    assert [o.type for o in response.output] == ["reasoning", "function_call"]
    assert response.output[1].name == "get_weather" and response.output[1].arguments == '{"city": "Paris"}'
    events = list(_respond(served, THINK_THEN_CALL, tools=tools, stream=True))
    assert [o.type for o in events[-1].response.output] == ["reasoning", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == (
        response.output[0].content[0].text
    )


def test_responses_structured_outputs_go_alone(served: Served) -> None:
    body = {
        "model": "tiny",
        "input": "Hi",
        "structured_outputs": {"regex": "[a-z]+"},
        "text": {"format": {"type": "json_object"}},
    }
    reply = httpx.post(served.url + "/v1/responses", json=body, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "structured_outputs"
    bad_effort = {"model": "tiny", "input": "Hi", "reasoning": {"effort": "extreme"}}
    reply = httpx.post(served.url + "/v1/responses", json=bad_effort, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "reasoning.effort"


# -- a grammar begins after the thinking (the default) ----------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Served with ``<think>`` and ``</think>`` as tokens of their own, as Qwen3's are, and grammars beginning after
    the thinking (no --structured-outputs-in-reasoning)."""
    with serve_hermes(
        tmp_path_factory.mktemp("thinker"),
        QWEN3_TEMPLATE,
        ServerConfig(reasoning_parser="qwen3"),
        added_tokens=("<think>", "</think>"),
    ) as s:
        yield s


def _ends_thinking_after_a_few_tokens(thinker: Served, tools: Any = None) -> tuple[dict[str, float], str]:
    """A logit bias on ``</think>`` under which the model, free, ends its thinking after some tokens of its own; and
    that thinking. A random model never writes the tag unbiased; the least bias that makes it write the tag within
    40 tokens (found by bisection) makes it write it where the model's own choice was weakest, seldom first."""
    (end,) = thinker.loaded.tokenizer.encode("</think>", add_special_tokens=False)
    prompt = thinker.loaded.tokenizer.apply_chat_template(ASK, tools=tools, open_think=True)

    def free(bias: float) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "logit_bias": {str(end): bias}}
        return httpx.post(thinker.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    lo, hi = 0.0, 60.0  # the tag is not written at lo, is at hi
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if "</think>" in free(mid) else (mid, hi)
    # Two logits past the least: at the least the tag ties with the model's own choice, and a chat's batch shapes
    # (other than the completions' here) may tip the tie either way.
    bias = hi + 2.0
    thought = free(bias).split("</think>")[0]
    assert thought, "the least bias that ends the thinking ends it at once"
    return {str(end): bias}, thought


def test_a_grammar_begins_once_the_model_has_thought(thinker: Served) -> None:
    bias, thought = _ends_thinking_after_a_few_tokens(thinker)
    opened = {"chat_template_kwargs": {"open_think": True}}  # a thinking model's template: the output thinks first
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    reply = thinker.client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=200, temperature=0, logit_bias=bias, response_format=schema,
        extra_body=opened,
    )  # fmt: skip
    message = reply.choices[0].message
    assert message.reasoning == thought  # the model's own thinking, not held to the schema
    assert json.loads(message.content)["city"] in ("Paris", "Rome")  # then the answer, held to it
    # A forced tool call, the agent's case: the call comes after the thinking (one: the random model would write more
    # until max_tokens cut one off, which then ends as "length").
    bias, thought = _ends_thinking_after_a_few_tokens(thinker, WEATHER_IN_TEMPLATE)
    forced = thinker.client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=200, temperature=0, logit_bias=bias, tools=WEATHER,
        tool_choice="required", parallel_tool_calls=False, extra_body=opened,
    )  # fmt: skip
    choice = forced.choices[0]
    assert choice.message.reasoning == thought and choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    # With the thinking turned off by the template, the grammar holds the output from its first token.
    off = thinker.client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=200, temperature=0, response_format=schema,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert off.choices[0].message.reasoning is None and json.loads(off.choices[0].message.content)["city"]


def test_anthropic_messages_put_the_reasoning_in_a_thinking_block(served: Served) -> None:
    """``/v1/messages``: a ``thinking`` block before the text, streamed as ``thinking_delta`` events first."""
    thought, answer = _text(served, THINK_THEN_ANSWER).removeprefix("<think>").split("</think>")
    client = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
    ask = {"model": "tiny", "max_tokens": 120, "messages": ASK}
    extra = {"temperature": 0, "structured_outputs": {"regex": THINK_THEN_ANSWER}}
    message = client.messages.create(**ask, extra_body=extra)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", thought),
        ("text", answer),
    ]
    with client.messages.stream(**ask, extra_body=extra) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert kinds.index("text_delta") > max(i for i, k in enumerate(kinds) if k == "thinking_delta")
    assert [b.type for b in streamed.content] == ["thinking", "text"]
    assert streamed.content[0].thinking == thought and streamed.content[1].text == answer


def test_anthropic_thinking_disabled_keeps_the_requests_template_variables(served: Served) -> None:
    """``thinking`` ``disabled`` sets Qwen3's ``enable_thinking`` beside the request's own ``chat_template_kwargs``
    (vLLM's, given beside Anthropic's fields): they were replaced by it, and the template lost them."""
    client = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
    off = {"model": "tiny", "messages": ASK, "thinking": {"type": "disabled"}}
    plain = client.messages.count_tokens(**off).input_tokens
    opened = client.messages.count_tokens(**off, extra_body={"chat_template_kwargs": {"open_think": True}})
    on = client.messages.count_tokens(model="tiny", messages=ASK).input_tokens
    assert plain > on  # (the empty thinking the template writes when it is off)
    assert opened.input_tokens > plain  # (and "<think>" opened after it, as the request's variable asks)


# -- a thinking budget ------------------------------------------------------------------------------------------------


def test_a_thinking_budget_closes_the_thinking_then_the_model_answers(thinker: Served) -> None:
    """``thinking_token_budget`` (vLLM's) and Anthropic's ``budget_tokens``: the random model, which never ends its
    thinking on its own, thinks its own first tokens, then the end tag is forced and it answers; streamed alike. The
    thinking is counted in the usage's reasoning tokens, tag included."""
    prompt = thinker.loaded.tokenizer.apply_chat_template(ASK, open_think=True)
    free = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    first = httpx.post(thinker.url + "/v1/completions", json=free, timeout=60).json()["choices"][0]["text"]
    assert "</think>" not in first
    opened = {"chat_template_kwargs": {"open_think": True}}
    ask = {"model": "tiny", "messages": ASK, "max_tokens": 30, "temperature": 0}
    unbudgeted = thinker.client.chat.completions.create(**ask, extra_body=opened)
    assert unbudgeted.choices[0].message.content is None  # all of it thinking
    reply = thinker.client.chat.completions.create(**ask, extra_body={**opened, "thinking_token_budget": 6})
    message = reply.choices[0].message
    assert message.reasoning == first and message.content  # type: ignore[attr-defined]
    assert reply.usage.completion_tokens_details.reasoning_tokens == 7  # type: ignore[union-attr]
    stream = thinker.client.chat.completions.create(
        **ask, stream=True, extra_body={**opened, "thinking_token_budget": 6}
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == first
    assert "".join(d.content or "" for d in deltas) == message.content
    claude_like = anthropic.Anthropic(base_url=thinker.url, api_key="x", max_retries=0)
    budgeted = claude_like.messages.create(
        model="tiny",
        max_tokens=30,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 6},
        extra_body={"temperature": 0, **opened},
    )
    assert [b.type for b in budgeted.content] == ["thinking", "text"]
    assert budgeted.content[0].thinking == first  # type: ignore[union-attr]


def test_a_bad_thinking_budget_is_a_400(thinker: Served) -> None:
    bad = {"model": "tiny", "messages": ASK, "max_tokens": 4, "thinking_token_budget": -1}
    reply = httpx.post(thinker.url + "/v1/chat/completions", json=bad, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "thinking_token_budget"
    anthropic_bad = {
        "model": "tiny",
        "max_tokens": 4,
        "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": 0},
    }
    reply = httpx.post(thinker.url + "/v1/messages", json=anthropic_bad, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
