"""gpt-oss's harmony output (``api/harmony.py``): vLLM's ``--reasoning-parser openai_gptoss`` and ``--tool-call-parser
openai``. The parsers on their own, whole and streamed in every chunking, cut off anywhere; then served: a random
model whose vocabulary holds harmony's tags as special tokens, held by a grammar to write chosen harmony outputs, read
through the real `openai` and `anthropic` clients on the chat route (streamed and not), the Responses API and
Anthropic's Messages API, with a harmony-style chat template of its own (not gpt-oss's) that reads an earlier turn's
reasoning as ``thinking``, as gpt-oss's does."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from served_models import streamed_parts

from boundless.api import harmony
from boundless.api.reasoning import (
    REASONING_PARSERS,
    ReasoningOutput,
    ReasoningParser,
    ReasoningStream,
    Split,
    reasoning_parser_name,
)
from boundless.api.server import ToolUse
from boundless.api.tool_calls import (
    ALL_FORMATS,
    HARMONY,
    TOOL_CALL_PARSERS,
    CallStream,
    ContentStream,
    keeps_special_tokens,
    parse_tool_calls,
)
from boundless.config import ServerConfig

GPT_OSS = ReasoningParser.named("openai_gptoss")
READ_CALLS = GPT_OSS.with_calls(True)  # (a request read for tool calls: the answer keeps them, for tool_calls)
OPENAI = TOOL_CALL_PARSERS["openai"]

THINK_ANSWER = "<|channel|>analysis<|message|>THINKING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER"
CALL = '{"location":"Tokyo"}'
# A call after the reasoning, its recipient after the channel (with <|constrain|>json) or after the role (with json).
THINK_CALL = (
    "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
    f"to=functions.get_weather <|constrain|>json<|message|>{CALL}"
)
ROLE_CALL = (
    "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather"
    f"<|channel|>commentary json<|message|>{CALL}"
)
PREAMBLE_CALL = (
    "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
    "Checking the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>"
    f"{CALL}"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (THINK_ANSWER, Split("THINKING", "ANSWER")),
        (THINK_ANSWER + "<|return|>", Split("THINKING", "ANSWER")),  # (the end-of-sequence tag, when the text keeps it)
        ("<|channel|>final<|message|>Just the answer.", Split(None, "Just the answer.")),
        ("<|channel|>analysis<|message|>cut off while thinking", Split("cut off while thinking", None)),
        ("<|channel|>analysis<|message|>done<|end|><|start|>assistant<|channel|>fin", Split("done", None)),  # (header)
        (
            "<|channel|>analysis<|message|>done<|end|><|start|>assistant<|channel|>final<|message|>cut",
            Split("done", "cut"),
        ),
        # Several messages: each part's bodies a line apart, as vLLM joins them.
        (
            "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
            "<|start|>assistant<|channel|>final<|message|>c",
            Split("a\nb", "c"),
        ),
        # A preamble (commentary with no recipient) is for the user: content.
        (
            "<|channel|>commentary<|message|>Let me see.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.",
            Split(None, "Let me see.\nSunny."),
        ),
        # A call is left out of the answer when calls are not read (no tools, or another tool-call parser).
        (THINK_CALL, Split("Need weather.", None)),
        (PREAMBLE_CALL, Split("Need weather.", "Checking the weather.")),
        # A built-in tool's message (a recipient that is no function) is not the answer: the model's own business.
        (
            "<|channel|>analysis to=python<|message|>print(1)<|call|>",
            Split("print(1)", None),
        ),
        ("No harmony at all.", Split(None, "No harmony at all.")),  # (a prompt that opened the final message)
        ("<|channel|>analysis<|message|><|end|>", Split("", None)),
        ("", Split(None, None)),
        # A model that leaves out an end tag: the next header ends the body all the same.
        ("<|channel|>analysis<|message|>x<|start|>assistant<|channel|>final<|message|>y", Split("x", "y")),
        ("<|channel|>analysis<|message|>x<|channel|>final<|message|>y<|endoftext|>", Split("x", "y")),
    ],
)
def test_split(text: str, expected: Split) -> None:
    assert GPT_OSS.split(text, opened=False) == expected


def test_calls_stay_in_the_answer_for_the_tool_call_parser() -> None:
    """Read for calls, the answer keeps each call in one form, whatever its header's order or constraint, and the
    ``openai`` tool-call parser reads it back: the function, the body as its arguments, the content around it."""
    for text in (THINK_CALL, ROLE_CALL, THINK_CALL + "<|call|>", THINK_CALL.replace(" <|constrain|>json", "")):
        split = READ_CALLS.split(text, opened=False)
        assert split.reasoning == "Need weather."
        content, calls = parse_tool_calls(split.content or "", None, OPENAI)
        assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", CALL)], text
        assert calls[0].id.startswith("call_")
    content, calls = parse_tool_calls(READ_CALLS.split(PREAMBLE_CALL, False).content or "", None, OPENAI)
    assert content == "Checking the weather." and [c.name for c in calls] == ["get_weather"]
    # Without --tool-call-parser every shape is read, harmony's too.
    assert parse_tool_calls(READ_CALLS.split(ROLE_CALL, False).content or "", None, ALL_FORMATS)[1][0].arguments == CALL
    # An empty body is a call without arguments; a name that is no function's (``functions.`` alone) is no call.
    empty = READ_CALLS.split("<|channel|>commentary to=functions.now<|message|>", False).content or ""
    assert [(c.name, c.arguments) for c in parse_tool_calls(empty, None, OPENAI)[1]] == [("now", "{}")]
    assert READ_CALLS.split("<|channel|>commentary to=functions.<|message|>{}", False) == Split("{}", None)


def test_a_prompt_that_opened_the_analysis_or_the_answer() -> None:
    assert GPT_OSS.opens_in_reasoning("<|start|>assistant<|channel|>analysis<|message|>")
    assert not GPT_OSS.opens_in_reasoning("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert GPT_OSS.closed_in("<|start|>assistant<|channel|>final<|message|>")
    assert not GPT_OSS.closed_in("<|start|>assistant")
    assert GPT_OSS.split("still thinking<|end|><|start|>assistant<|channel|>final<|message|>A", opened=True) == Split(
        "still thinking", "A"
    )
    assert GPT_OSS.split("cut", opened=True) == Split("cut", None)


def test_the_tags_the_engine_acts_on() -> None:
    """A thinking budget forces the analysis message's end tag (the model then goes on to answer or call), counted from
    the analysis opening the output must begin with; an answer's grammar begins after the final message's opening
    (where vLLM's parser ends the reasoning); the tags are special tokens, kept in the decoded text."""
    assert GPT_OSS.start == "<|channel|>analysis<|message|>" and GPT_OSS.end == "<|end|>"
    assert GPT_OSS.answer_after == "<|channel|>final" and GPT_OSS.answer_close == "<|message|>" and GPT_OSS.special_tags
    assert ReasoningParser.named("qwen3").answer_close == ""
    assert ReasoningParser.named("qwen3").answer_after == "</think>"
    assert GPT_OSS.ends_in_reasoning("<|channel|>analysis<|message|>cut", opened=False)
    assert not GPT_OSS.ends_in_reasoning(THINK_ANSWER, opened=False)


def test_the_parser_names() -> None:
    assert "openai_gptoss" in REASONING_PARSERS and {HARMONY} == OPENAI and HARMONY in ALL_FORMATS
    ServerConfig(reasoning_parser="openai_gptoss", tool_call_parser="openai")  # (the flags take the names)
    assert keeps_special_tokens("openai", None)
    # --tool-call-parser openai reads gpt-oss's messages with its reasoning parser, as vLLM reads every gpt-oss output.
    assert reasoning_parser_name(None, "openai") == "openai_gptoss"
    assert reasoning_parser_name("qwen3", "openai") == "qwen3" and reasoning_parser_name(None, "hermes") is None


TEXTS = [
    THINK_ANSWER,
    THINK_ANSWER + "<|return|>",
    THINK_CALL,
    ROLE_CALL + "<|call|>",
    PREAMBLE_CALL,
    "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>c<|end|><|start|>assistant<|channel|>final<|message|>d",
    "<|channel|>analysis<|message|>cut off <|en",
    "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>a <|st and more",
    "<|channel|>analysis to=browser.search<|message|>{}<|call|>",
    "to the point, no harmony",
    "<|channel|>commentary to=functions.a<|message|>{}<|end|><|start|>assistant to=functions.b<|channel|>commentary"
    '<|message|>{"x": 1}',
    "",
    " \n ",
]


@pytest.mark.parametrize("calls", [False, True], ids=["calls-not-read", "calls-read"])
@pytest.mark.parametrize("opened", [False, True])
def test_a_stream_sends_what_the_whole_output_splits_into(calls: bool, opened: bool) -> None:
    """In every chunking (pieces of 1 to 6 characters, 30 random ones per text, and a tag at a time as the model writes
    them), the pieces sent add up to the split of the whole text: a header is held until it is whole, a body's tail
    that may begin a tag until it is known, so nothing sent is taken back."""
    parser = GPT_OSS.with_calls(calls)
    rng = random.Random(0)
    for text in TEXTS:
        split = parser.split(text, opened)
        tags = [m.end() for m in re.finditer(r"<\|[a-z]+\|>", text)] + [len(text)]
        for chunking in range(31):
            cuts = tags if chunking == 30 else None
            stream, reasoning, content, at = ReasoningStream(parser, opened), "", "", 0
            while at < len(text):
                at = min(len(text), at + rng.randint(1, 6)) if cuts is None else next(c for c in cuts if c > at)
                new_reasoning, new_content = stream.feed(text[:at])
                reasoning, content = reasoning + new_reasoning, content + new_content
                assert parser.visible(text[:at], opened, final=False)[1] == content  # (each a prefix of the next)
            new_reasoning, new_content = stream.feed(text, final=True)
            reasoning, content = reasoning + new_reasoning, content + new_content
            assert (reasoning, content or None) == (split.reasoning or "", split.content), text


def _served_as_streamed(text: str, tools: ToolUse) -> tuple[str | None, str, list[tuple[str, str]]]:
    """``text`` streamed as the chat route streams it, a character at a time: reasoning first, its answer through
    ContentStream and CallStream (-> reasoning, content, calls as a client puts them together)."""
    reasoning = ReasoningOutput(GPT_OSS.with_calls(tools.used and HARMONY in tools.formats), opened=False)
    thoughts, contents = reasoning.stream(), ContentStream(tools.formats)
    call_stream = CallStream(tools.parallel, None, False, tools.formats)
    thought, content, deltas = "", "", []
    for end in range(1, len(text) + 1):
        new_thought, _ = thoughts.feed(text[:end], final=end == len(text))
        thought += new_thought
        if end < len(text):
            content += contents.feed(thoughts.content)
            if contents.held:
                deltas += call_stream.feed(thoughts.content, contents.sent)
    rest, calls = tools.finish(contents, thoughts.content)
    content += rest
    deltas += call_stream.finish(calls) if calls else []
    together: dict[int, list[str]] = {}
    for d in deltas:
        entry = together.setdefault(d["index"], ["", ""])
        entry[0] += d["function"].get("name", "")
        entry[1] += d["function"]["arguments"]
    return thought or None, content, [(n, a) for n, a in (together[i] for i in sorted(together))]


@pytest.mark.parametrize("formats", [OPENAI, ALL_FORMATS], ids=["openai", "no parser"])
@pytest.mark.parametrize("text", [THINK_CALL, ROLE_CALL, PREAMBLE_CALL, THINK_ANSWER])
def test_calls_stream_as_the_unstreamed_response_reads_them(text: str, formats: frozenset[str]) -> None:
    tools = ToolUse(True, formats=formats)
    split = ReasoningOutput(GPT_OSS.with_calls(True), opened=False).split(text)
    content, calls, _ = tools.read(split.content or "")
    streamed = _served_as_streamed(text, tools)
    assert streamed == (split.reasoning, content or "", [(c.name, c.arguments) for c in calls])
    assert (streamed[2] == [("get_weather", CALL)]) == (text != THINK_ANSWER)


def test_calls_ended_by_end_tags_then_an_answer_stream_as_read() -> None:
    """Two calls each ended by ``<|end|>`` (not ``<|call|>``), then a final message: streamed, each call is its own, as
    the unstreamed response reads them (the first call's reader, fed on while the second's tag was not yet whole, ran
    past it and took the second call into its arguments: a third, garbled call; the fuzzer's find)."""
    text = (
        "<|channel|>commentary to=functions.f<|message|>{}<|end|><|start|>assistant<|channel|>commentary to=functions.g"
        '<|message|>{"b":2}<|end|><|start|>assistant<|channel|>final<|message|>x'
    )
    tools = ToolUse(True, formats=OPENAI)
    split = ReasoningOutput(GPT_OSS.with_calls(True), opened=False).split(text)
    content, calls, _ = tools.read(split.content or "")
    assert [(c.name, c.arguments) for c in calls] == [("f", "{}"), ("g", '{"b":2}')]
    assert _served_as_streamed(text, tools) == (None, content or "", [("f", "{}"), ("g", '{"b":2}')])


def test_a_call_cut_off_is_a_call_as_far_as_it_got() -> None:
    """An output that reached max_tokens inside a call's body: the call as far as it got, which the route reports
    with finish reason ``length`` (ToolUse.read's cut position); one whose body the end-of-sequence ``<|call|>``
    ended (left out of the text) is whole."""
    cut = THINK_CALL[: THINK_CALL.index("Tokyo")]
    answer = READ_CALLS.split(cut, False).content or ""
    tools = ToolUse(True, formats=OPENAI)
    content, calls, cut_at = tools.read(answer, at_length=True)
    assert (
        content is None
        and cut_at is not None
        and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"location":"')]
    )
    assert tools.read(answer, at_length=False)[2] is None
    whole = READ_CALLS.split(THINK_CALL, False).content or ""
    assert tools.read(whole, at_length=False)[1][0].arguments == CALL


def test_reasoning_tokens_are_the_analysis_messages() -> None:
    """``usage``'s reasoning tokens: those of the analysis messages, headers and end tags included; a tag a token,
    as in gpt-oss's vocabulary."""
    pieces = re.findall(r"<\|[a-z]+\|>|[^<]", THINK_ANSWER)  # (a tag a token, else a character a token)
    vocabulary = {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}
    ids = [vocabulary[p] for p in pieces]
    names = {i: p for p, i in vocabulary.items()}

    def decode(token_ids: Any) -> str:
        return "".join(names[i] for i in token_ids)

    thinking = len(re.findall(r"<\|[a-z]+\|>|[^<]", "<|channel|>analysis<|message|>THINKING<|end|>"))
    assert ReasoningOutput(GPT_OSS, opened=False).tokens(ids, decode) == thinking
    assert ReasoningOutput(GPT_OSS, opened=False).tokens(ids[:13], decode) == 13  # (cut off inside it)
    answer_only = [vocabulary[p] for p in pieces[thinking:]]
    assert ReasoningOutput(GPT_OSS, opened=False).tokens(answer_only, decode) == 0


def test_an_assistant_turns_content_gives_way_to_its_reasoning_before_calls() -> None:
    """gpt-oss's template writes one analysis message before a turn's calls, and refuses a turn with both content and
    reasoning: a preamble this server returned beside the calls would make the next turn a 400, so it gives way."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Checking.", "reasoning": "need f", "tool_calls": [call]},
        {"role": "assistant", "content": "Done.", "reasoning": "all good"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
    ]
    out = harmony.harmony_turns(turns)
    assert out[1] == {**turns[1], "content": None} and out[2:] == turns[2:] and turns[1]["content"] == "Checking."


# -- served ------------------------------------------------------------------------------------------------------------

SPECIAL = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>")
# A harmony-style template of this test's own: tools in a developer message, each turn a message, an assistant's
# calls after one analysis message (its reasoning, read as ``thinking`` as gpt-oss's template reads it, or else its
# content; both refused, as gpt-oss's template refuses them), and ``open_analysis`` or ``open_final`` to open the
# output's analysis or its final message in the prompt.
HARMONY_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>{% endif %}"
    "{% if tools %}<|start|>developer<|message|>{% for t in tools %}{{ t.function.name }}: "
    "{{ t.function.parameters | tojson }}\n{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}"
    "{% if m.content and m.thinking %}{{ raise_exception('both content and thinking before calls') }}{% endif %}"
    "{% if m.thinking or m.content %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ m.thinking or m.content }}<|end|>{% endif %}"
    "{% for c in m.tool_calls %}<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json"
    "<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant"
    "{% if open_analysis is defined and open_analysis %}<|channel|>analysis<|message|>{% endif %}"
    "{% if open_final is defined and open_final %}<|channel|>final<|message|>{% endif %}{% endif %}"
)


class Served:
    """The tiny model served on 127.0.0.1 as ``tiny`` with harmony's tags special tokens of its vocabulary and
    gpt-oss's end-of-sequence tokens (``<|return|>`` first, ``<|call|>``), and the `openai` client pointed at it."""

    def __init__(self, directory: Path, config: ServerConfig) -> None:
        from tokenizers import AddedToken, Tokenizer

        from boundless.api.launch import start_in_thread
        from boundless.engine.async_engine import AsyncEngine
        from boundless.engine.core import EngineCore
        from boundless.llm import engine_config
        from boundless.model.loader import load_model
        from boundless.model.random_model import TinySpec, write_random_model

        root = write_random_model(directory / "m", TinySpec(vocab_size=384 + len(SPECIAL)))
        tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
        tokenizer.save(str(root / "tokenizer.json"))
        ends = [tokenizer.token_to_id(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")]
        (root / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
        tokenizer_config = json.loads((root / "tokenizer_config.json").read_text())
        tokenizer_config.update(chat_template=HARMONY_TEMPLATE, eos_token="<|return|>")
        (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        self.loaded = load_model(str(root))
        self.engine = AsyncEngine(
            EngineCore.from_model(self.loaded, engine_config(str(root), max_model_len=1024, kv_cache_gb=0.05))
        )
        self.thread = start_in_thread(self.engine, "tiny", config)
        self.url = self.thread.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0)

    def close(self) -> None:
        self.thread.stop()
        self.engine.shutdown()

    def ask(self, regex: str | None, **kwargs: Any) -> dict[str, Any]:
        """A chat request's arguments: held to ``regex`` (None: free), harmony's tags favoured wherever the grammar
        allows them, so that the model writes each as the one token it is."""
        tokens = self.loaded.tokenizer
        bias = {str(tokens.encode(t, add_special_tokens=False)[0]): 100 for t in SPECIAL}
        extra = {"structured_outputs": {"regex": regex}} if regex else {}
        return {
            "model": "tiny",
            "messages": kwargs.pop("messages", ASK),
            "max_tokens": kwargs.pop("max_tokens", 300),
            "temperature": 0,
            "logit_bias": bias,
            "extra_body": {**extra, **kwargs.pop("extra_body", {})},
            **kwargs,
        }

    def streamed(self, ask: dict[str, Any]) -> dict[str, Any]:
        """A streamed chat put together (:func:`served_models.streamed_parts`)."""
        return streamed_parts(self.client, ask)


ASK = [{"role": "user", "content": "Weather in Tokyo?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}
ANALYSIS = r"<\|channel\|>analysis<\|message\|>[a-z ]{4,12}<\|end\|>"
ANSWER_REGEX = ANALYSIS + r"<\|start\|>assistant<\|channel\|>final<\|message\|>[a-z ]{2,8}"
CALL_REGEX = (
    ANALYSIS + r"<\|start\|>assistant<\|channel\|>commentary to=functions\.get_weather <\|constrain\|>json"
    r'<\|message\|>\{"location":"Tokyo"\}'
)
PREAMBLE_THEN_ANSWER = (
    r"<\|channel\|>commentary<\|message\|>Checking\.<\|end\|><\|start\|>assistant"
    + ANALYSIS
    + r"<\|start\|>assistant<\|channel\|>final<\|message\|>[a-z]{2,8}"
)
# (a preamble longer than the headers after it: an answer read as the text's end would take them in)
LONG_PREAMBLE = "Checking the weather in Tokyo for you, one moment please."
ANSWER_AFTER_PREAMBLE = (
    ANALYSIS
    + r"<\|start\|>assistant<\|channel\|>commentary<\|message\|>"
    + re.escape(LONG_PREAMBLE).replace("\\ ", " ")  # (xgrammar's regexes take a blank as it is)
    + r"<\|end\|>"
    + r"<\|start\|>assistant<\|channel\|>final<\|message\|>[a-z]{2,8}"
)
PREAMBLE_REGEX = (
    ANALYSIS + r"<\|start\|>assistant<\|channel\|>commentary<\|message\|>Checking\.<\|end\|>"
    r'<\|start\|>assistant to=functions\.get_weather<\|channel\|>commentary json<\|message\|>\{"location":"Tokyo"\}'
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = ServerConfig(
        reasoning_parser="openai_gptoss", tool_call_parser="openai", structured_outputs_in_reasoning=True
    )
    s = Served(tmp_path_factory.mktemp("harmony"), config)
    yield s
    s.close()


def _written(served: Served, choice: Any) -> tuple[str, str]:
    """What the model wrote, tags and all (the choice's ``token_ids``, decoded keeping special tokens): its analysis
    body and what followed it."""
    text = served.loaded.tokenizer.decode(choice.token_ids, skip_special_tokens=False)
    found = re.fullmatch(r"<\|channel\|>analysis<\|message\|>(.*?)<\|end\|>(.*?)(<\|return\|>|<\|call\|>)?", text)
    assert found, text
    return found.group(1), found.group(2)


def test_served_reasoning_then_an_answer(served: Served) -> None:
    ask = served.ask(ANSWER_REGEX, extra_body={"return_token_ids": True})
    reply = served.client.chat.completions.create(**ask)
    choice = reply.choices[0]
    thought, rest = _written(served, choice)
    answer = rest.removeprefix("<|start|>assistant<|channel|>final<|message|>")
    message = choice.message
    assert (message.reasoning, message.reasoning_content, message.content) == (thought, thought, answer)  # type: ignore[attr-defined]
    assert choice.finish_reason == "stop"
    # The reasoning tokens are the analysis message's, its end tag included.
    end = served.loaded.tokenizer.encode("<|end|>", add_special_tokens=False)[0]
    thought_tokens = choice.token_ids.index(end) + 1  # type: ignore[attr-defined]
    assert reply.usage.completion_tokens_details.reasoning_tokens == thought_tokens  # type: ignore[union-attr]
    streamed = served.streamed(served.ask(ANSWER_REGEX))
    assert (streamed["reasoning"], streamed["content"], streamed["finish"]) == (thought, answer, "stop")
    assert streamed["usage"].completion_tokens_details.reasoning_tokens == thought_tokens


@pytest.mark.parametrize("regex", [ANSWER_REGEX, PREAMBLE_THEN_ANSWER], ids=["answer", "preamble-analysis-answer"])
@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["no tools", "tools"])
def test_served_logprobs_are_the_answers_tokens(served: Served, tools: Any, regex: str) -> None:
    """A message's logprobs are its content's tokens (and the end-of-sequence token after it), not the reasoning's nor
    the headers' between its messages (nor the line that joins them, which no token wrote), streamed and not, read
    for calls or not."""
    ask = served.ask(regex, logprobs=True, **({"tools": tools} if tools else {}))
    whole = served.client.chat.completions.create(**ask).choices[0]
    tokens = [t.token for t in whole.logprobs.content]  # type: ignore[union-attr]
    content = whole.message.content or ""
    assert "".join(tokens[:-1]) == content.replace("\n", "") and whole.message.reasoning  # type: ignore[attr-defined]
    assert tokens[-1] in ("<|return|>", "<|call|>")  # (the end-of-sequence token the grammar ended with)
    assert content.startswith("Checking.\n") == (regex == PREAMBLE_THEN_ANSWER)
    assert served.streamed(ask)["logprobs"] == tokens


@pytest.mark.parametrize(
    ("regex", "content"), [(CALL_REGEX, None), (PREAMBLE_REGEX, "Checking.")], ids=["after-channel", "after-role"]
)
def test_served_a_call_after_the_reasoning(served: Served, regex: str, content: str | None) -> None:
    """A call to ``functions.get_weather``, its recipient after the channel or after the role: a tool call with the
    message's body as its arguments, finish reason ``tool_calls``, and a preamble as the content (its tokens the
    logprobs), streamed and not; sent back with the reasoning, the next turn's template reads it as ``thinking``."""
    ask = served.ask(regex, tools=[WEATHER], logprobs=True)
    choice = served.client.chat.completions.create(**ask).choices[0]
    message = choice.message
    logprobs = [t.token for t in choice.logprobs.content or ()]  # type: ignore[union-attr]
    assert "".join(logprobs) == (content or "")
    assert choice.finish_reason == "tool_calls" and message.content == content and message.reasoning  # type: ignore[attr-defined]
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or ()] == [("get_weather", CALL)]
    assert message.tool_calls[0].id.startswith("call_")  # type: ignore[index]
    streamed = served.streamed(ask)
    assert (streamed["reasoning"], streamed["content"], streamed["finish"]) == (
        message.reasoning,  # type: ignore[attr-defined]
        content or "",
        "tool_calls",
    )
    assert [(n, a) for i, n, a in streamed["calls"]] == [("get_weather", CALL)] and streamed["calls"][0][0]
    assert streamed["logprobs"] == logprobs
    # The turn sent back as the client got it (reasoning, a preamble, the call) and the call's result: the template
    # reads the reasoning as the analysis before the call (the preamble gives way to it: the template refuses both).
    turn = {**message.model_dump(exclude_none=True), "role": "assistant"}
    messages = [*ASK, turn, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]  # type: ignore[index]
    prompt = httpx.post(served.url + "/tokenize", json={"model": "tiny", "messages": messages}, timeout=30)
    assert prompt.status_code == 200, prompt.text
    rendered = served.loaded.tokenizer.decode(prompt.json()["tokens"], skip_special_tokens=False)
    assert f"<|channel|>analysis<|message|>{message.reasoning}<|end|><|start|>assistant to=functions.get_weather" in (  # type: ignore[attr-defined]
        rendered
    )
    follow = served.client.chat.completions.create(**served.ask(None, messages=messages, tools=[WEATHER], max_tokens=2))
    assert follow.choices[0].finish_reason == "length"


def test_served_a_forced_call(served: Served) -> None:
    """A forced call (``tool_choice`` required) is written by its grammar as a JSON list of calls, which the ``openai``
    parser reads beside harmony's own calls (here the grammar holds the whole output: the list is the answer)."""
    ask = {**served.ask(None, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), "logit_bias": None}
    choice = served.client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls" and [c.function.name for c in choice.message.tool_calls or ()] == [
        "get_weather"
    ]
    streamed = served.streamed(ask)
    assert streamed["finish"] == "tool_calls" and [n for _, n, _ in streamed["calls"]] == ["get_weather"]


def test_served_earlier_reasoning_reaches_the_template_as_thinking(served: Served) -> None:
    """An assistant turn's reasoning, under vLLM's name or the older one, reaches the template as ``thinking``, the
    name gpt-oss's template reads."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALL}}
    for key in ("reasoning", "reasoning_content"):
        turn = {"role": "assistant", "content": None, key: "look it up", "tool_calls": [call]}
        messages = [*ASK, turn, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        reply = httpx.post(served.url + "/tokenize", json={"model": "tiny", "messages": messages}, timeout=30)
        rendered = served.loaded.tokenizer.decode(reply.json()["tokens"], skip_special_tokens=False)
        assert "<|channel|>analysis<|message|>look it up<|end|>" in rendered, key


def test_served_a_call_cut_off_comes_as_far_as_it_got(served: Served) -> None:
    ask = served.ask(CALL_REGEX, tools=[WEATHER], extra_body={"return_token_ids": True})
    whole = served.client.chat.completions.create(**ask).choices[0]
    cut_ask = {**ask, "max_tokens": len(whole.token_ids) - 3}  # type: ignore[attr-defined]
    choice = served.client.chat.completions.create(**cut_ask).choices[0]
    (call,) = choice.message.tool_calls or ()
    assert choice.finish_reason == "length" and call.function.name == "get_weather"
    assert CALL.startswith(call.function.arguments) and call.function.arguments != CALL
    streamed = served.streamed(cut_ask)
    assert streamed["finish"] == "length" and [(n, a) for _, n, a in streamed["calls"]] == [
        ("get_weather", call.function.arguments)
    ]


def test_served_without_tools_a_call_is_no_content(served: Served) -> None:
    """Not read for calls (the request has no tools), a call message is left out of the answer, as vLLM leaves it."""
    choice = served.client.chat.completions.create(**served.ask(PREAMBLE_REGEX)).choices[0]
    assert choice.message.content == "Checking." and not choice.message.tool_calls
    assert served.streamed(served.ask(PREAMBLE_REGEX))["content"] == "Checking."


def test_served_responses_api(served: Served) -> None:
    """The Responses API: the reasoning as a reasoning item before the message or the function call, streamed first."""
    extra = {"structured_outputs": {"regex": ANSWER_REGEX}}
    ask: dict[str, Any] = {"model": "tiny", "input": "Weather in Tokyo?", "temperature": 0, "max_output_tokens": 200}
    bias = served.ask(None)["logit_bias"]
    response = served.client.responses.create(**ask, extra_body={**extra, "logit_bias": bias})
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text  # type: ignore[union-attr,index]
    assert message.type == "message" and re.fullmatch("[a-z ]{2,8}", response.output_text)
    events = list(served.client.responses.create(**ask, stream=True, extra_body={**extra, "logit_bias": bias}))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert (thought, text) == (reasoning.content[0].text, response.output_text)  # type: ignore[union-attr,index]
    # The message's logprobs are its text's tokens (a preamble's and the final message's, not the header between
    # them), streamed and whole alike.
    logprobs = {
        "include": ["message.output_text.logprobs"],
        "extra_body": {"structured_outputs": {"regex": ANSWER_AFTER_PREAMBLE}, "logit_bias": bias},
    }
    whole = served.client.responses.create(**ask, **logprobs)  # type: ignore[arg-type]
    assert whole.output_text.startswith(LONG_PREAMBLE + "\n")
    tokens = [lp.token for lp in whole.output[1].content[0].logprobs]  # type: ignore[union-attr,index]
    assert "".join(tokens[:-1]) == whole.output_text.replace("\n", "")
    events = list(served.client.responses.create(**ask, stream=True, **logprobs))  # type: ignore[arg-type]
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]  # type: ignore[union-attr]
    assert streamed == tokens
    # Analysis may follow a preamble (and more analysis): the items come in the order they began, each streamed
    # whole before its done event, as the unstreamed response has them.
    for regex, order in ((PREAMBLE_THEN_ANSWER, ["message", "reasoning"]), (THINK_TWICE, ["reasoning", "message"])):
        asked = {"structured_outputs": {"regex": regex}, "logit_bias": bias}
        whole = served.client.responses.create(**ask, extra_body=asked)
        assert [o.type for o in whole.output] == order
        events = list(served.client.responses.create(**ask, stream=True, extra_body=asked))
        assert _items_streamed(events) == [_text_of(o) for o in whole.output]
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    calling = {**extra, "structured_outputs": {"regex": PREAMBLE_REGEX}, "logit_bias": bias}
    called = served.client.responses.create(**ask, tools=tools, extra_body=calling)  # type: ignore[arg-type]
    assert [o.type for o in called.output] == ["reasoning", "message", "function_call"]
    assert called.output_text == "Checking."
    call = called.output[2]
    assert (call.name, call.arguments) == ("get_weather", CALL)  # type: ignore[union-attr]
    # The next response of the chain continues from the call's turn (its reasoning, its preamble, its call), which
    # the template takes: the reasoning before the call.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}  # type: ignore[union-attr]
    follow = served.client.responses.create(
        model="tiny",
        previous_response_id=called.id,
        input=[result],
        max_output_tokens=1,  # type: ignore[list-item]
    )
    assert follow.status == "incomplete"


THINK_TWICE = (
    ANALYSIS
    + r"<\|start\|>assistant<\|channel\|>commentary<\|message\|>Checking\.<\|end\|><\|start\|>assistant"
    + ANALYSIS
    + r"<\|start\|>assistant<\|channel\|>final<\|message\|>[a-z]{2,8}"
)


def _text_of(item: Any) -> tuple[str, str]:
    return item.type, item.content[0].text


def _items_streamed(events: list[Any]) -> list[tuple[str, str]]:
    """A Responses stream's items as its events build them, in output order, each item's deltas all before its done
    event (whose item holds what they added up to)."""
    items: dict[int, list[str]] = {}
    done: set[int] = set()
    for e in events:
        if e.type == "response.output_item.added":
            assert e.output_index == len(items)
            items[e.output_index] = [e.item.type, ""]
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            assert e.output_index not in done
            items[e.output_index][1] += e.delta
        elif e.type == "response.output_item.done":
            done.add(e.output_index)
            assert (e.item.type, e.item.content[0].text) == tuple(items[e.output_index])
    assert done == set(items) and [_text_of(o) for o in events[-1].response.output] == [
        tuple(i) for i in items.values()
    ]
    return [(kind, text) for kind, text in items.values()]


def test_served_anthropic_messages(served: Served) -> None:
    """Anthropic's Messages API: a thinking block, then the text or the tool_use block, streamed alike."""
    client = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
    bias = served.ask(None)["logit_bias"]
    ask: dict[str, Any] = {"model": "tiny", "max_tokens": 200, "messages": ASK}
    extra = {"temperature": 0, "logit_bias": bias, "structured_outputs": {"regex": ANSWER_REGEX}}
    message = client.messages.create(**ask, extra_body=extra)
    assert [b.type for b in message.content] == ["thinking", "text"] and message.stop_reason == "end_turn"
    with client.messages.stream(**ask, extra_body=extra) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in streamed.content] == [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content
    ]
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    calling = {**extra, "structured_outputs": {"regex": CALL_REGEX}}
    called = client.messages.create(**ask, tools=[tool], extra_body=calling)  # type: ignore[list-item]
    assert [b.type for b in called.content] == ["thinking", "tool_use"] and called.stop_reason == "tool_use"
    assert called.content[1].input == {"location": "Tokyo"}  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def calls_flag_alone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Served with ``--tool-call-parser openai`` alone (vLLM's gpt-oss recipe): grammars begin after the thinking."""
    s = Served(tmp_path_factory.mktemp("harmony_calls"), ServerConfig(tool_call_parser="openai"))
    yield s
    s.close()


def test_served_with_the_tool_call_parser_alone(calls_flag_alone: Served) -> None:
    """``--tool-call-parser openai`` alone reads the messages as the reasoning parser does: after a prompt that opened
    the final message (so the grammar holds the output from its first token), the answer, then a call."""
    served = calls_flag_alone
    regex = (
        r"[a-z]{2,8}<\|end\|><\|start\|>assistant to=functions\.get_weather<\|channel\|>commentary json"
        r'<\|message\|>\{"location":"Tokyo"\}'
    )
    ask = served.ask(regex, tools=[WEATHER], extra_body={"chat_template_kwargs": {"open_final": True}})
    choice = served.client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning is None  # type: ignore[attr-defined]
    assert choice.message.content and re.fullmatch("[a-z]{2,8}", choice.message.content)
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()] == [("get_weather", CALL)]
    streamed = served.streamed(ask)
    assert streamed["content"] == choice.message.content and [(n, a) for _, n, a in streamed["calls"]] == [
        ("get_weather", CALL)
    ]


def test_served_a_thinking_budget_ends_the_analysis(calls_flag_alone: Served) -> None:
    """``thinking_token_budget``: after that many tokens of the analysis the prompt opened, ``<|end|>`` is forced, and
    what the random model writes after it is the answer; the reasoning tokens are the analysis's, its end tag too."""
    served = calls_flag_alone
    opened = {"chat_template_kwargs": {"open_analysis": True}, "return_token_ids": True}
    ask = {"model": "tiny", "messages": ASK, "temperature": 0}
    free = served.client.chat.completions.create(**ask, max_tokens=6, extra_body=opened).choices[0]
    special = {served.loaded.tokenizer.encode(t, add_special_tokens=False)[0] for t in SPECIAL}
    assert not special & set(free.token_ids) and free.message.content is None  # type: ignore[attr-defined]
    budget = {**opened, "thinking_token_budget": 6}
    reply = served.client.chat.completions.create(**ask, max_tokens=30, extra_body=budget)
    message = reply.choices[0].message
    assert message.reasoning == free.message.reasoning and message.content  # type: ignore[attr-defined]
    assert reply.usage.completion_tokens_details.reasoning_tokens == 7  # type: ignore[union-attr]


def test_the_server_holds_a_grammar_and_a_budget_to_harmonys_tags(calls_flag_alone: Served) -> None:
    """The grammar of an answer begins after the final message's header, ``<|channel|>final`` to ``<|message|>`` (from
    the start when the prompt opened the final message, ``<|constrain|>json`` in its header or not); a thinking budget
    forces ``<|end|>``, counted from the analysis opening the output begins with (nothing when the prompt opened
    it)."""
    from boundless.api.server import OpenAIServer
    from boundless.engine.structured_output import StructuredOutput

    server = OpenAIServer(calls_flag_alone.engine, "tiny", ServerConfig(tool_call_parser="openai"))
    tokens = calls_flag_alone.loaded.tokenizer

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokens.encode(text, add_special_tokens=False))

    grammar = StructuredOutput("json_object", None, "response_format")
    prompt = list(ids("<|start|>user<|message|>Hi<|end|><|start|>assistant"))
    held = server.after_reasoning(grammar, prompt)
    assert (held.after, held.after_close) == (ids("<|channel|>final"), ids("<|message|>"))
    for header in ("<|channel|>final<|message|>", "<|channel|>final <|constrain|>json<|message|>"):
        assert server.after_reasoning(grammar, prompt + list(ids(header))).after == ()
    analysing = prompt + list(ids("<|channel|>analysis<|message|>"))
    assert server.after_reasoning(grammar, analysing).after == ids("<|channel|>final")
    budget = server.thinking_budget(6, prompt)
    assert budget is not None and (budget.end, budget.start) == (ids("<|end|>"), ids("<|channel|>analysis<|message|>"))
    opened = server.thinking_budget(6, prompt + list(ids("<|channel|>analysis<|message|>")))
    assert opened is not None and opened.start == ()


def test_a_harmony_vocabulary_is_read_so_without_a_flag(calls_flag_alone: Served) -> None:
    """As vLLM reads every gpt-oss output: a model whose vocabulary holds harmony's tags has its messages read with no
    flag (a plain text answer would be its tags and channels verbatim); a flag named wins, and a model of another
    vocabulary reads none."""
    from boundless.api.reasoning import reasoning_parser_name
    from boundless.api.server import OpenAIServer

    unflagged = OpenAIServer(calls_flag_alone.engine, "tiny", ServerConfig())
    assert unflagged.reasoning is not None and unflagged.reasoning.name == "openai_gptoss"
    tokenizer = calls_flag_alone.loaded.tokenizer
    assert reasoning_parser_name("qwen3", None, tokenizer) == "qwen3"

    class Plain:
        def token_to_id(self, token: str) -> int | None:
            return None if token == "<|channel|>" else 1

    assert reasoning_parser_name(None, None, Plain()) is None
    assert reasoning_parser_name(None, "openai", Plain()) == "openai_gptoss"
