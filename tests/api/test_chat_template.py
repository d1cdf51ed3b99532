"""``--chat-template`` (vLLM's flag): chat requests to a model without a template of its own (a base model), or with a
template other than its own; and ``LLM.chat``'s ``chat_template``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from boundless.api.launch import start_in_thread
from boundless.api.server import configured_chat_template
from boundless.cli import main
from boundless.config import ConfigError, ServerConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import LLM, engine_config
from boundless.model.loader import load_model
from boundless.model.random_model import TinySpec, write_random_model

TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
RENDERED = "[system] Be brief.\n[user] Hi there\n>"


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model whose tokenizer has no chat template, as a base model's has none."""
    root = write_random_model(tmp_path_factory.mktemp("base") / "m", TinySpec())
    config = json.loads((root / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def _chat(url: str, messages: list[dict]) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("given_as", ["file", "text"])
def test_chat_template_flag_serves_chat_to_a_model_without_one(base_model: Path, tmp_path: Path, given_as: str) -> None:
    """Without the flag a base model's chat requests are refused (400, no template); with it, as a file or as the
    template itself, the prompt is the flag's template rendered (the ids /tokenize and the usage report)."""
    loaded = load_model(str(base_model))
    engine = AsyncEngine(
        EngineCore.from_model(loaded, engine_config(str(base_model), max_model_len=512, kv_cache_gb=0.05))
    )
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    flag = str(tmp_path / "t.jinja") if given_as == "file" else TEMPLATE
    plain = start_in_thread(engine, "tiny")
    templated = start_in_thread(engine, "tiny", ServerConfig(chat_template=flag))
    try:
        refused = _chat(plain.url, MESSAGES)
        assert refused.status_code == 400 and "no chat template" in refused.json()["error"]["message"]
        expected = loaded.tokenizer.encode(RENDERED, add_special_tokens=False)
        reply = _chat(templated.url, MESSAGES)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == len(expected)
        tokens = httpx.post(templated.url + "/tokenize", json={"model": "tiny", "messages": MESSAGES}, timeout=60)
        assert tokens.json()["tokens"] == expected
    finally:
        plain.stop()
        templated.stop()
        engine.shutdown()


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("/no/such/template.jinja", "is no file, nor a template"),
        ("{% for m in messages %}", "not a valid Jinja template"),
    ],
)
def test_a_bad_chat_template_is_refused_before_the_model_loads(
    value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped path is an error, not a template that prints the path; a template that does not compile fails at
    start-up, not at every chat request. ``serve`` says so in one line and exits 2, before loading the model."""
    with pytest.raises(ConfigError, match=said):
        configured_chat_template(ServerConfig(chat_template=value))
    assert main(["serve", "--chat-template", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("boundless: --chat-template: ") and said in err and "Traceback" not in err


def test_llm_chat_takes_a_template(base_model: Path, tmp_path: Path) -> None:
    """``LLM.chat(chat_template=...)`` renders with it (vLLM's argument), and its kwargs reach the template."""
    llm = LLM(str(base_model), max_model_len=512, kv_cache_gb=0.05)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(MESSAGES, params)
    out = llm.chat(MESSAGES, params, chat_template=TEMPLATE)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode(RENDERED, add_special_tokens=False)
    with pytest.raises(ValueError, match="cannot set 'tokenize'"):
        llm.chat(MESSAGES, params, chat_template_kwargs={"tokenize": True})
    tagged = llm.chat(MESSAGES, params, chat_template=TEMPLATE + "{{ tag }}", chat_template_kwargs={"tag": "!"})[0]
    assert tagged.prompt_token_ids == llm.tokenizer.encode(RENDERED + "!", add_special_tokens=False)
    # A file's path, as serve --chat-template takes it; the kwargs may set the route's own variables too (vLLM's).
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    bare = llm.chat(
        MESSAGES, params, chat_template=str(tmp_path / "t.jinja"), chat_template_kwargs={"add_generation_prompt": False}
    )[0]
    assert bare.prompt_token_ids == llm.tokenizer.encode(RENDERED[:-1], add_special_tokens=False)
    with pytest.raises(ValueError, match="is no file, nor a template"):
        llm.chat(MESSAGES, params, chat_template="/no/such.jinja")


def test_a_template_given_as_text_has_its_escapes_decoded_as_vllm_does() -> None:
    """A one-line template from the shell writes its line breaks as ``\\n``: vLLM decodes them, so the same command
    line rendered other prompts here, with a backslash and an ``n`` where the model was trained on a line break.
    Characters beyond ASCII stay as written."""
    one_line = TEMPLATE.replace("\n", "\\n")
    assert "\n" not in one_line and configured_chat_template(ServerConfig(chat_template=one_line)) == TEMPLATE
    assert configured_chat_template(ServerConfig(chat_template=TEMPLATE)) == TEMPLATE
    assert configured_chat_template(ServerConfig(chat_template="é{{ x }}中\\t")) == "é{{ x }}中\t"
