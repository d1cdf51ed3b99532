"""Boundless renders a chat request's conversation as vLLM does: vLLM's conversion of OpenAI's messages (restated in
:func:`vllm_conversation`) handed to transformers' ``apply_chat_template``, against the chat path's own conversion
(``template_conversation``) and renderer, on the real templates of the families served (``templates/``, sources in
its README) and a matrix of conversations, tools, and ``add_generation_prompt``, ``continue_final_message`` and
template variables as the route takes them; and through the server's ``/tokenize``."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from boundless.api.conversation import template_conversation
from boundless.api.launch import start_in_thread
from boundless.config import ServerConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.llm import engine_config
from boundless.model.loader import load_model
from boundless.model.random_model import TinySpec, write_random_model
from boundless.model.tokenizer import Tokenizer, template_content_format

TEMPLATES = Path(__file__).parent / "templates"
NAMES = sorted(p.name for p in TEMPLATES.glob("*.jinja"))
# The templates that loop over a message's content, which vLLM hands a list of text parts ("openai"); the rest
# take one text ("string").
READ_PARTS = {"vllm-tool_chat_template_llama3.1_json.jinja", "Mistral-Small-3.2-24B-Instruct-2506.jinja"}


def vllm_conversation(messages: list[dict[str, Any]], content_format: str) -> list[dict[str, Any]]:
    """What vLLM's ``parse_chat_messages`` makes of OpenAI messages for a template of ``content_format``
    (``_parse_chat_message_content`` for each message, then ``_postprocess_messages``): content as text parts
    (a string one part, None none), joined by newlines for a "string" template and for a tool result; an assistant's
    ``tool_calls`` and reasoning (as ``reasoning`` and ``reasoning_content``), a tool result's ``tool_call_id``, and
    a string ``name`` kept; then each assistant call's arguments parsed from their JSON (``{}`` when they are none, or
    no JSON), and an empty list of calls dropped. (vLLM keeps ``developer`` as its own role: Boundless makes it
    ``system``, so no conversation here has one.)"""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content")
        parts = [] if content is None else [{"type": "text", "text": content}] if isinstance(content, str) else content
        texts = [p["text"] for p in parts]
        msg: dict[str, Any] = {"role": role}
        if content_format == "openai" and role != "tool":
            msg["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            msg["content"] = "\n".join(texts)
        if role == "assistant":
            if m.get("tool_calls") is not None:
                msg["tool_calls"] = copy.deepcopy(m["tool_calls"])
            if m.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        if role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    for msg in out:
        if msg["role"] != "assistant" or not isinstance(msg.get("tool_calls"), list):
            continue
        if not msg["tool_calls"]:
            del msg["tool_calls"]
        for call in msg.get("tool_calls", []):
            arguments = call["function"].get("arguments")
            if isinstance(arguments, str):
                try:
                    call["function"]["arguments"] = json.loads(arguments)
                except json.JSONDecodeError:
                    call["function"]["arguments"] = {}
            elif not isinstance(arguments, dict | list):
                call["function"]["arguments"] = {}
    return out


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_ID = "abcDEF123"  # Mistral's templates take ids of 9 characters
LONG_ID = "call_0123456789abcdef"  # OpenAI's: vLLM's Mistral template keeps the last 9


def _call(arguments: Any, call_id: str = CALL_ID) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def _parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


SYSTEM = {"role": "system", "content": "Be brief."}
ASK = {"role": "user", "content": "Weather in Paris?"}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "system": [SYSTEM, {"role": "user", "content": "Hi there"}],
    "no_system": [{"role": "user", "content": "Hi there"}],
    "multi_turn": [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": " Weather? "},
    ],
    "text_parts": [
        {"role": "system", "content": _parts("Be brief.", "Be kind.")},
        {"role": "user", "content": _parts("Hello", " World ")},
    ],
    "tool_round": [
        SYSTEM,
        ASK,
        {"role": "assistant", "content": None, "tool_calls": [_call('{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temp": 20}'},
    ],
    "tool_result_parts": [
        ASK,
        {"role": "assistant", "content": None, "tool_calls": [_call('{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": _parts('{"temp": 20}', "sunny")},
    ],
    "tool_then_answer": [
        ASK,
        {"role": "assistant", "content": "", "tool_calls": [_call('{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "20"},
        {"role": "assistant", "content": "It is 20 degrees."},
        {"role": "user", "content": "Thanks"},
    ],
    "empty_arguments": [
        ASK,
        {"role": "assistant", "content": "", "tool_calls": [_call("")]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "ok"},
    ],
    "arguments_not_json": [
        ASK,
        {"role": "assistant", "content": "", "tool_calls": [_call('{"city": ')]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "ok"},
    ],
    "openai_call_id": [
        ASK,
        {"role": "assistant", "content": None, "tool_calls": [_call('{"city": "Paris"}', LONG_ID)]},
        {"role": "tool", "tool_call_id": LONG_ID, "content": "20"},
    ],
    "reasoning": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning": "The user greets."},
        ASK,
        {"role": "assistant", "content": None, "reasoning": "Call the tool.", "tool_calls": [_call('{"city": "P"}')]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "20"},
    ],
    "thinking_in_content": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
    ],
    "calls_on_a_user_turn": [{"role": "user", "content": "Hi", "tool_calls": [_call("{}")]}],
    "named": [{"role": "user", "content": "Hi", "name": "ann"}],
}
PREFILLS: dict[str, list[dict[str, Any]]] = {
    "prefill": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}],
    "prefill_parts": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": _parts("One,", "two,")}],
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    """Boundless's tokenizer and transformers' of the same files (the text they render is what is compared)."""
    from transformers import AutoTokenizer

    root = write_random_model(tmp_path_factory.mktemp("tok") / "m", weights=False)
    return Tokenizer.from_hf_dir(root), AutoTokenizer.from_pretrained(root)


def _render(render: Any) -> str:
    """A render's text, or its error's type: a conversation a template refuses is refused by both."""
    try:
        return render()
    except Exception as e:
        return f"refused ({type(e).__name__})"


def _both(
    tokenizers: tuple[Tokenizer, Any], name: str, messages: list[dict[str, Any]], **kwargs: Any
) -> tuple[str, str]:
    ours, reference = tokenizers
    source = (TEMPLATES / name).read_text(encoding="utf-8")
    content_format = "openai" if name in READ_PARTS else "string"
    expected = _render(
        lambda: reference.apply_chat_template(
            vllm_conversation(messages, content_format), chat_template=source, tokenize=False, **kwargs
        )
    )
    got = _render(lambda: ours.apply_chat_template(template_conversation(messages), chat_template=source, **kwargs))
    return got, expected


@pytest.mark.parametrize("name", NAMES)
def test_content_format_is_found_as_vllm_finds_it(name: str) -> None:
    """vLLM hands a template that loops over a message's content a list of text parts, any other one text."""
    expected = "openai" if name in READ_PARTS else "string"
    assert template_content_format((TEMPLATES / name).read_text(encoding="utf-8")) == expected


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}{% endfor %}"
         "{% endfor %}", "openai"),
        # the conversation under another name, set from it (sliced, filtered) before the loop
        ("{% set rest = messages[1:] %}{% set turns = rest | list %}{% for m in turns %}{% for p in m['content'] %}"
         "{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        # a loop over the content's text (characters), over another variable's content, over a message not looped
        ("{% for m in messages %}{% for c in m['content'] | trim %}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in documents %}{% for p in m['content'] %}{% endfor %}{% endfor %}", "string"),
        ("{% for p in messages[0]['content'] %}{% endfor %}", "string"),
        ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{% endfor %}{% endfor %}", "string"),
    ],
)  # fmt: skip
def test_content_format_follows_vllms_rule(template: str, expected: str) -> None:
    """vLLM's rule: parts for a ``for`` over ``message.content`` or ``message['content']`` (through filters, tests
    and slices) where ``message`` is a loop's variable over the conversation (``messages`` or a variable set from
    it); a template it cannot parse reads one text."""
    assert template_content_format(template) == expected
    assert template_content_format("{% for m in messages %}") == "string"


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", NAMES)
def test_conversations_render_as_vllm_renders_them(
    tokenizers: tuple[Tokenizer, Any], name: str, conversation: str
) -> None:
    """With and without tools, with and without the generation prompt: the same prompt, or refused by both."""
    for tools in (None, [WEATHER]):
        for add_generation_prompt in (True, False):
            got, expected = _both(
                tokenizers, name, CONVERSATIONS[conversation], tools=tools, add_generation_prompt=add_generation_prompt
            )
            assert got == expected, (tools is not None, add_generation_prompt)


@pytest.mark.parametrize("conversation", sorted(PREFILLS))
@pytest.mark.parametrize("name", NAMES)
def test_continue_final_message_renders_as_vllm_renders_it(
    tokenizers: tuple[Tokenizer, Any], name: str, conversation: str
) -> None:
    """``continue_final_message`` (with ``add_generation_prompt`` false, as vLLM takes it): the prompt ends inside
    the final assistant turn, as transformers cuts it, in either content format."""
    got, expected = _both(tokenizers, name, PREFILLS[conversation], add_generation_prompt=False,
                          continue_final_message=True)  # fmt: skip
    assert got == expected


@pytest.mark.parametrize(
    ("name", "variables"),
    [
        ("Qwen-Qwen3-8B.jinja", {"enable_thinking": False}),
        ("Qwen-Qwen3-0.6B.jinja", {"enable_thinking": False}),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", {"tools_in_user_message": False, "date_string": "01 Jan 2025"}),
        ("vllm-tool_chat_template_llama3.1_json.jinja", {"tools_in_user_message": False}),
        ("meta-llama-Llama-3.2-3B-Instruct.jinja", {"date_string": "01 Jan 2025"}),
    ],
)
def test_chat_template_kwargs_render_as_vllm_renders_them(
    tokenizers: tuple[Tokenizer, Any], name: str, variables: dict[str, Any]
) -> None:
    """``chat_template_kwargs`` reach the template as its variables, as vLLM passes them to transformers."""
    for conversation in ("tool_round", "reasoning", "text_parts"):
        got, expected = _both(
            tokenizers, name, CONVERSATIONS[conversation], tools=[WEATHER], add_generation_prompt=True, **variables
        )
        assert got == expected and not got.startswith("refused"), conversation


def test_token_ids_match_transformers(tokenizers: tuple[Tokenizer, Any]) -> None:
    """The ids too: the rendered prompt encoded without added special tokens, as vLLM encodes a chat prompt."""
    ours, reference = tokenizers
    source = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
    messages = CONVERSATIONS["tool_round"]
    kwargs = {"chat_template": source, "tools": [WEATHER], "add_generation_prompt": True, "tokenize": True}
    expected = reference.apply_chat_template(vllm_conversation(messages, "string"), return_dict=False, **kwargs)
    assert ours.apply_chat_template(template_conversation(messages), **kwargs) == list(expected)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random model's engine, and its directory."""
    root = write_random_model(tmp_path_factory.mktemp("served") / "m", TinySpec())
    loaded = load_model(str(root))
    engine = AsyncEngine(EngineCore.from_model(loaded, engine_config(str(root), max_model_len=2048, kv_cache_gb=0.05)))
    try:
        yield root, loaded, engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("name", "variables"),
    [
        ("vllm-tool_chat_template_llama3.1_json.jinja", {"date_string": "01 Jan 2025"}),  # content read as parts
        ("vllm-tool_chat_template_mistral.jinja", {}),  # OpenAI's call ids, cut to their last 9 characters
        ("Qwen-Qwen3-8B.jinja", {"enable_thinking": False}),
    ],
)
def test_the_server_renders_as_vllm(engine: Any, name: str, variables: dict[str, Any]) -> None:
    """``serve --chat-template``, through ``/tokenize`` with ``messages``, ``tools`` and ``chat_template_kwargs``:
    the ids of the prompt vLLM renders, from the request's JSON (calls' arguments as JSON text, content as parts)."""
    from transformers import AutoTokenizer

    root, loaded, async_engine = engine
    reference = AutoTokenizer.from_pretrained(root)
    source = (TEMPLATES / name).read_text(encoding="utf-8")
    content_format = "openai" if name in READ_PARTS else "string"
    server = start_in_thread(async_engine, "tiny", ServerConfig(chat_template=str(TEMPLATES / name)))
    try:
        for conversation in ("text_parts", "tool_round", "empty_arguments", "openai_call_id", "reasoning"):
            messages = CONVERSATIONS[conversation]
            body = {"model": "tiny", "messages": messages, "tools": [WEATHER], "chat_template_kwargs": variables}
            reply = httpx.post(server.url + "/tokenize", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            text = reference.apply_chat_template(
                vllm_conversation(messages, content_format),
                chat_template=source,
                tools=[WEATHER],
                tokenize=False,
                add_generation_prompt=True,
                **variables,
            )
            assert reply.json()["tokens"] == loaded.tokenizer.encode(text, add_special_tokens=False), conversation
    finally:
        server.stop()
