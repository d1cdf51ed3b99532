"""A small random model served with a chat template that takes tools (Hermes style), for the API tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import openai

from boundless.api.launch import start_in_thread
from boundless.config import ServerConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.llm import engine_config
from boundless.model.generation_config import model_sampling_defaults
from boundless.model.loader import LoadedModel, load_model
from boundless.model.random_model import TinySpec, write_random_model

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\\nTools:\\n"
    "{% for t in tools %}{{ t | tojson }}\\n{% endfor %}<|im_end|>\\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}"
)


# Two tools the API tests give (chat-shaped): one with a string parameter, one whose values a grammar can only
# write a few ways (a boolean, an enum).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

UNITS = {
    "type": "function",
    "function": {
        "name": "set_units",
        "parameters": {
            "type": "object",
            "properties": {"metric": {"type": "boolean"}, "scale": {"enum": ["C", "F", "K"]}},
            "required": ["metric", "scale"],
        },
    },
}


def streamed_parts(client: openai.OpenAI, ask: dict[str, Any]) -> dict[str, Any]:
    """A chat completion streamed and put together as a client does: its ``content``, ``reasoning``, ``calls`` (id,
    name, arguments) in order of index, ``finish`` reason, ``usage`` and the content's ``logprobs`` tokens."""
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "finish": None, "logprobs": [], "usage": None}
    for chunk in client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}):
        out["usage"] = chunk.usage or out["usage"]
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            out["reasoning"] += delta.get("reasoning") or ""
            out["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                entry = out["calls"].setdefault(call["index"], ["", "", ""])
                entry[0] += call.get("id") or ""
                entry[1] += call["function"].get("name") or ""
                entry[2] += call["function"].get("arguments") or ""
            out["finish"] = choice.finish_reason or out["finish"]
            out["logprobs"] += [t.token for t in choice.logprobs.content or ()] if choice.logprobs else []
    out["calls"] = [tuple(out["calls"][i]) for i in sorted(out["calls"])]
    return out


def streamed_chat(client: openai.OpenAI, ask: dict) -> tuple[str, str | None, list[tuple[str, str]]]:
    """:func:`streamed_parts`' content, finish reason and tool calls (name, arguments)."""
    parts = streamed_parts(client, ask)
    return parts["content"], parts["finish"], [(name, arguments) for _, name, arguments in parts["calls"]]


class Served(NamedTuple):
    """A model served on 127.0.0.1 as ``tiny``, with the real `openai` client pointed at it."""

    loaded: LoadedModel
    engine: AsyncEngine
    url: str
    client: openai.OpenAI


@contextmanager
def serve_hermes(
    directory: Path,
    template: str = HERMES_TEMPLATE,
    server_config: ServerConfig | None = None,
    added_tokens: tuple[str, ...] = (),
    generation_config: dict | None = None,
) -> Iterator[Served]:
    """A random model written to ``directory`` whose chat template takes tools (``template``, in which ``\\n`` stands
    for a newline), served until the block ends. ``added_tokens``: tokens of one id each in its vocabulary beside the
    trained ones (not special: they stay in decoded text), as Qwen3's ``<think>`` and ``</think>`` are.
    ``generation_config``: the model's ``generation_config.json`` (its sampling defaults, which the server applies as
    ``boundless serve`` does)."""
    root = write_random_model(directory / "m", TinySpec(vocab_size=384 + len(added_tokens)))
    if added_tokens:
        from tokenizers import AddedToken, Tokenizer

        tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
        tokenizer.save(str(root / "tokenizer.json"))
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["chat_template"] = template.replace("\\n", "\n")
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (root / "generation_config.json").write_text(json.dumps(generation_config))
    loaded = load_model(str(root))
    engine = AsyncEngine(EngineCore.from_model(loaded, engine_config(str(root), max_model_len=1024, kv_cache_gb=0.05)))
    given = server_config or ServerConfig()
    defaults = model_sampling_defaults(str(root), given.generation_config, given.generation_overrides)
    server = start_in_thread(engine, "tiny", server_config, defaults=defaults)
    try:
        yield Served(loaded, engine, server.url, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0))
    finally:
        server.stop()
        engine.shutdown()
