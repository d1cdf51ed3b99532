"""``POST /v1/embeddings`` through the real ``openai`` client on a served random Qwen3: transformers' last hidden
states, normalized; floats and base64; a Matryoshka model's ``dimensions``; bad input gets a 400 or a 404, and the
server goes on serving completions."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np
import openai
import pytest
import torch

from boundless.api.launch import start_in_thread
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.llm import engine_config
from boundless.model.loader import load_configured_model
from boundless.model.pooling import EmbeddingPooling

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Agents remember what they read", "hi"]


class Server(NamedTuple):
    path: Path
    url: str
    client: openai.OpenAI


@pytest.fixture(scope="module")
def served(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """tiny-qwen3 as a Matryoshka embedding model (``is_matryoshka`` in its config.json)."""
    path = Path(shutil.copytree(model_dirs["tiny-qwen3"], tmp_path_factory.mktemp("embed") / "m"))
    config_file = path / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "is_matryoshka": True}))
    config = engine_config(str(path), max_model_len=64, kv_cache_gb=0.01)
    engine = AsyncEngine(EngineCore.from_model(load_configured_model(config.model), config))
    server = start_in_thread(engine, "tiny")
    try:
        yield Server(path, server.url, openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0))
    finally:
        server.stop()
        engine.shutdown()


def _reference(path: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), torch_dtype=torch.float32)
    with torch.inference_mode():
        last = [model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]
    return [torch.nn.functional.normalize(h, dim=-1).numpy() for h in last]


def _tokens(served: Server, texts: list[str]) -> list[list[int]]:
    return [httpx.post(f"{served.url}/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]


def test_texts_embed_as_transformers_last_hidden_states(served: Server) -> None:
    reply = served.client.embeddings.create(model="tiny", input=TEXTS)
    expected = _reference(served.path, _tokens(served, TEXTS))
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.object == "list" and reply.model == "tiny"
    for item, reference in zip(reply.data, expected, strict=True):
        assert np.allclose(item.embedding, reference, atol=1e-4)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(t) for t in _tokens(served, TEXTS))
    one = served.client.embeddings.create(model="tiny", input=TEXTS[0])  # (a text alone)
    assert np.allclose(one.data[0].embedding, expected[0], atol=1e-4)
    ids = served.client.embeddings.create(model="tiny", input=[[5, 6, 7], [8, 9]])  # token ids
    assert np.allclose(ids.data[1].embedding, _reference(served.path, [[8, 9]])[0], atol=1e-4)


def test_base64_is_the_float32_bytes_and_dimensions_cut_and_normalize_again(served: Server) -> None:
    floats = served.client.embeddings.create(model="tiny", input=TEXTS[1]).data[0].embedding
    raw = httpx.post(
        f"{served.url}/v1/embeddings", json={"model": "tiny", "input": TEXTS[1], "encoding_format": "base64"}
    ).json()["data"][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(raw), dtype="<f4"), floats, atol=1e-6)
    raw = httpx.post(f"{served.url}/v1/embeddings", json={"model": "tiny", "input": TEXTS[1], "normalize": False})
    raw_vector = np.asarray(raw.json()["data"][0]["embedding"])
    assert np.allclose(raw_vector / np.linalg.norm(raw_vector), floats, atol=1e-5) and np.linalg.norm(raw_vector) > 1.5
    cut = served.client.embeddings.create(model="tiny", input=TEXTS[1], dimensions=16).data[0].embedding
    assert len(cut) == 16 and abs(np.linalg.norm(cut) - 1) < 1e-5
    assert np.allclose(cut, np.asarray(floats[:16]) / np.linalg.norm(floats[:16]), atol=1e-6)


@pytest.mark.parametrize(
    ("body", "status", "said"),
    [
        ({"model": "tiny", "input": ""}, 400, "input must not be empty"),
        ({"model": "tiny", "input": []}, 400, "input must not be empty"),
        ({"model": "tiny", "input": [[1, 2], []]}, 400, "input must not be empty"),
        ({"model": "tiny", "input": [10**9]}, 400, "input"),
        ({"model": "tiny", "input": "x", "dimensions": 0}, 400, "dimensions must be at least 1"),
        ({"model": "tiny", "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"model": "other", "input": "x"}, 404, "does not exist"),
        ({"model": "tiny", "input": [7] * 65}, 400, "context"),
        ({"model": "tiny", "input": "x", "dimensions": 1000}, 400, "exceed the model's 64"),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_server_goes_on(
    served: Server, body: dict, status: int, said: str
) -> None:
    reply = httpx.post(f"{served.url}/v1/embeddings", json=body, timeout=30)
    assert reply.status_code == status, reply.text
    assert said in reply.json()["error"]["message"] or said == reply.json()["error"].get("param")
    answer = served.client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert answer.choices[0].finish_reason == "length"


def test_a_prompt_may_fill_the_context(served: Server) -> None:
    reply = served.client.embeddings.create(model="tiny", input=[[7] * 64])
    assert np.allclose(reply.data[0].embedding, _reference(served.path, [[7] * 64])[0], atol=1e-4)


def test_more_inputs_than_the_engine_lets_wait_run_in_waves_and_no_matryoshka_no_dimensions(
    model_dirs: dict[str, Path],
) -> None:
    """Ten inputs to an engine that lets four wait: all ten embedded, in order (more inputs than ``--max-waiting`` were
    refused with a 400 naming ``n``, where an embedding client sends a thousand at a time); a model whose config says
    nothing of Matryoshka refuses ``dimensions``."""
    config = engine_config(str(model_dirs["tiny-llama"]), max_model_len=64, kv_cache_gb=0.01)
    engine = AsyncEngine(EngineCore.from_model(load_configured_model(config.model), config), max_waiting=4)
    server = start_in_thread(engine, "tiny")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        inputs = [[5 + i, 6, 7 + i] for i in range(10)]
        reply = client.embeddings.create(model="tiny", input=inputs)
        assert [d.index for d in reply.data] == list(range(10))
        expected = _reference(model_dirs["tiny-llama"], inputs)
        assert all(np.allclose(d.embedding, e, atol=1e-4) for d, e in zip(reply.data, expected, strict=True))
        with pytest.raises(openai.BadRequestError, match="does not support Matryoshka"):
            client.embeddings.create(model="tiny", input="x", dimensions=8)
    finally:
        server.stop()
        engine.shutdown()


def test_a_model_that_lists_its_matryoshka_dimensions_takes_only_those() -> None:
    pooling = EmbeddingPooling(matryoshka=True, dimensions=(16, 32))
    assert pooling.dimensions_refusal(16, "m") is None
    assert "only the dimensions it was trained for: [16, 32], not 20" in (pooling.dimensions_refusal(20, "m") or "")


def test_pooling_ping_and_sagemakers_invocations(served: Server) -> None:
    """vLLM's ``/pooling`` (the engine's pooled states), and SageMaker's ``/ping`` and ``/invocations`` (the body's
    shape names the route)."""
    pooled = httpx.post(f"{served.url}/pooling", json={"input": TEXTS[:2]}).json()
    embedded = served.client.embeddings.create(model="tiny", input=TEXTS[:2])
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    raw_cut = httpx.post(f"{served.url}/pooling", json={"input": TEXTS[0], "dimensions": 16, "normalize": False}).json()
    raw = httpx.post(f"{served.url}/pooling", json={"input": TEXTS[0], "normalize": False}).json()
    assert raw_cut["data"][0]["data"] == pytest.approx(raw["data"][0]["data"][:16], abs=1e-6)
    assert all(
        np.allclose(p["data"], e.embedding, atol=1e-6) for p, e in zip(pooled["data"], embedded.data, strict=True)
    )
    assert httpx.get(f"{served.url}/ping").json() == {"status": "ok"} and httpx.post(f"{served.url}/ping").is_success
    invoke = f"{served.url}/invocations"
    embedding = httpx.post(invoke, json={"model": "tiny", "input": TEXTS[0]}).json()
    assert np.allclose(embedding["data"][0]["embedding"], embedded.data[0].embedding, atol=1e-6)
    completion = httpx.post(invoke, json={"model": "tiny", "prompt": "Hello", "max_tokens": 3}).json()
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 3
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(invoke, json=chat).json()["object"] == "chat.completion"
    nothing = httpx.post(invoke, json={"model": "tiny"})
    assert nothing.status_code == 400 and "names no route" in nothing.json()["error"]["message"]
    bad = httpx.post(invoke, json={"model": "tiny", "prompt": "x", "max_tokens": "many"})
    assert bad.status_code == 400 and "max_tokens" in bad.text


def test_a_client_that_serves_no_pooling_refuses_it_in_words() -> None:
    """Prefill and decode engines (their front ends' ``pooling`` is None): an embedding request's one step would be the
    prefill engine's, its end a hand-off."""
    from types import SimpleNamespace

    from boundless.api.embeddings import served_pooling
    from boundless.api.errors import APIError
    from boundless.cluster.client import DispatcherFrontEnd

    assert DispatcherFrontEnd.pooling is None  # (the PD front ends'; ClusterClient sets its instances' otherwise)
    with pytest.raises(APIError, match="not served by prefill and decode engines") as refused:
        served_pooling(SimpleNamespace(client=SimpleNamespace(pooling=None)))
    assert refused.value.status == 400
