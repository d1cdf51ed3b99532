"""Classifiers (``model/classifier.py``): a ``*ForSequenceClassification`` checkpoint's head, and a causal LM's head
rows named by ``classifier_from_token`` (Qwen3-Reranker's yes/no), score as transformers does; through ``LLM.score``
and ``LLM.classify`` and the server's ``/score``, ``/rerank`` and ``/classify``."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from boundless.api.launch import start_in_thread
from boundless.config import ConfigError
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.core import EngineCore
from boundless.engine.errors import InvalidRequestError
from boundless.llm import LLM, engine_config
from boundless.model.loader import load_configured_model

# BOUNDLESS_TEST_DEVICE=cuda runs them on a GPU (scripts/gpu-check.sh), against transformers on the CPU.
DEVICE = os.environ.get("BOUNDLESS_TEST_DEVICE", "cpu")
QUERY = "What do agents remember?"
DOCUMENTS = ["Agents remember the tools they called.", "The sea is blue.", "Memory of past calls helps agents."]


def _classifier_dir(source: Path, target: Path, labels: int) -> Path:
    """A random ``Qwen2ForSequenceClassification`` (transformers' own, saved) with ``source``'s shape and tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(str(source))
    config.architectures = ["Qwen2ForSequenceClassification"]
    config.num_labels = labels
    config.id2label = {i: f"class-{i}" for i in range(labels)}
    config.label2id = {f"class-{i}": i for i in range(labels)}
    config.pad_token_id = 0
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(str(target))
    for tokenizer_file in source.glob("tokenizer*"):
        shutil.copy(tokenizer_file, target)
    return target


@contextmanager
def _serving(path: Path, name: str) -> Iterator[str]:
    """``path``'s model served on 127.0.0.1 as ``name``: its URL."""
    config = engine_config(str(path), max_model_len=128, kv_cache_gb=0.01, device=DEVICE)
    engine = AsyncEngine(EngineCore.from_model(load_configured_model(config.model), config))
    server = start_in_thread(engine, name)
    try:
        yield server.url
    finally:
        server.stop()
        engine.shutdown()


def _hf_logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(path), torch_dtype=torch.float32)
    with torch.inference_mode():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


def test_a_cross_encoder_scores_pairs_as_transformers(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = _classifier_dir(model_dirs["tiny-qwen2"], tmp_path / "cross", labels=1)
    llm = LLM(str(path), max_model_len=256, kv_cache_gb=0.01, device=DEVICE)
    try:
        pairs = [llm.get_tokenizer().encode_pair(QUERY, d) for d in DOCUMENTS]
        expected = [torch.sigmoid(logits)[0].item() for logits in _hf_logits(path, pairs)]
        got = llm.score(QUERY, DOCUMENTS)
        assert [r.prompt_token_ids for r in got] == pairs
        assert [r.outputs.score for r in got] == pytest.approx(expected, abs=1e-5)
        with pytest.raises(InvalidRequestError, match="is a classifier: it serves /classify, /score and /rerank"):
            llm.generate(["Hello"])  # (a sequence classifier's checkpoint writes no text)
        with pytest.raises(ValueError, match="is a classifier"):
            llm.embed(["Hello"])
    finally:
        llm.close()


def test_a_pair_past_its_budget_loses_its_documents_tail_not_its_query(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """``truncate_prompt_tokens``: a long document's last tokens go, the query stays (transformers' longest_first);
    the score then still depends on the query. Request ids are the engine's, distinct from call to call."""
    path = _classifier_dir(model_dirs["tiny-qwen2"], tmp_path / "cut", labels=1)
    llm = LLM(str(path), max_model_len=256, kv_cache_gb=0.01, device=DEVICE)
    try:
        tokenizer = llm.get_tokenizer()
        document = " ".join(["the tools they called"] * 20)
        query_ids = tokenizer.encode(QUERY, add_special_tokens=False)
        budget = 2 * len(query_ids) + 4  # (longest_first: the document is cut to the query's length before it is)
        (cut,) = llm.score(QUERY, document, truncate_prompt_tokens=budget)
        assert len(cut.prompt_token_ids) <= budget and cut.prompt_token_ids[: len(query_ids)] == query_ids
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(path))(QUERY, document, truncation=True, max_length=budget)
        assert cut.prompt_token_ids == hf["input_ids"]  # (transformers' longest_first, token for token)
        (other,) = llm.score("Where is the sea?", document, truncate_prompt_tokens=budget)
        assert other.outputs.score != cut.outputs.score
        assert other.request_id != cut.request_id
        expected = torch.sigmoid(_hf_logits(path, [cut.prompt_token_ids])[0])[0].item()
        assert cut.outputs.score == pytest.approx(expected, abs=1e-5)
    finally:
        llm.close()


def test_an_identity_activation_scores_by_the_logit(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A sentence-transformers CrossEncoder whose config says its activation is Identity (ms-marco's): the raw logit."""
    path = _classifier_dir(model_dirs["tiny-qwen2"], tmp_path / "raw", labels=1)
    config = json.loads((path / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), max_model_len=256, kv_cache_gb=0.01, device=DEVICE)
    try:
        pairs = [llm.get_tokenizer().encode_pair(QUERY, d) for d in DOCUMENTS]
        expected = [logits[0].item() for logits in _hf_logits(path, pairs)]
        assert [r.outputs.score for r in llm.score(QUERY, DOCUMENTS)] == pytest.approx(expected, abs=1e-5)
    finally:
        llm.close()


def test_a_split_cross_encoder_scores_as_one_device(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = _classifier_dir(model_dirs["tiny-qwen2"], tmp_path / "split", labels=1)
    scores = []
    for ranks in (1, 2):
        llm = LLM(str(path), max_model_len=128, kv_cache_gb=0.01, tensor_parallel_size=ranks)
        try:
            scores.append([r.outputs.score for r in llm.score(QUERY, DOCUMENTS)])
        finally:
            llm.close()
    assert scores[1] == pytest.approx(scores[0], abs=1e-5)


def test_a_classifier_of_three_labels_gives_their_probabilities(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = _classifier_dir(model_dirs["tiny-qwen2"], tmp_path / "three", labels=3)
    llm = LLM(str(path), max_model_len=256, kv_cache_gb=0.01, device=DEVICE)
    try:
        prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
        expected = [torch.softmax(logits, dim=-1) for logits in _hf_logits(path, prompts)]
        got = llm.classify(prompts)
        for result, probs in zip(got, expected, strict=True):
            assert result.outputs.num_classes == 3
            assert torch.allclose(torch.tensor(result.outputs.probs), probs, atol=1e-5)
        with pytest.raises(ValueError, match="classifies into 3 labels"):
            llm.score(QUERY, DOCUMENTS)
    finally:
        llm.close()


def test_classifier_from_token_scores_by_the_lm_heads_rows(model_dirs: dict[str, Path]) -> None:
    """vLLM's Qwen3-Reranker recipe (``--hf-overrides``): the relevance is sigmoid(logit(yes) - logit(no)) at the
    pair's last position, from the causal LM's own head; the model still writes text."""
    from transformers import AutoModelForCausalLM

    from boundless.model.tokenizer import Tokenizer

    path = model_dirs["tiny-llama"]
    tokenizer = Tokenizer.from_hf_dir(path)
    # Two texts of one token each in the tiny vocabulary (its "no" and "yes" are two tokens: refused in words).
    texts = {i: tokenizer.decode([i]) for i in range(100, 200)}
    words = [w for i, w in texts.items() if tokenizer.encode(w, add_special_tokens=False) == [i]]
    no_word, yes_word = words[:2]
    with pytest.raises(ConfigError, match="classifier_from_token 'no' is 2 tokens, not one"):
        LLM(str(path), max_model_len=256, kv_cache_gb=0.01, hf_overrides={"classifier_from_token": ["no", "yes"]})
    overrides = {"classifier_from_token": [no_word, yes_word]}
    llm = LLM(str(path), max_model_len=256, kv_cache_gb=0.01, device=DEVICE, hf_overrides=overrides)
    try:
        no, yes = (tokenizer.encode(t, add_special_tokens=False)[0] for t in (no_word, yes_word))
        pairs = [tokenizer.encode(QUERY + d) for d in DOCUMENTS]  # (vLLM's for such a model: the texts as one)
        model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
        with torch.inference_mode():
            last = [model(torch.tensor([p])).logits[0, -1] for p in pairs]
        expected = [torch.sigmoid(logits[yes] - logits[no]).item() for logits in last]
        got = llm.score(QUERY, DOCUMENTS)
        assert [r.prompt_token_ids for r in got] == pairs
        assert [r.outputs.score for r in got] == pytest.approx(expected, abs=1e-5)
        assert llm.generate(["Hello"])[0].outputs[0].token_ids
    finally:
        llm.close()


def test_the_server_scores_reranks_and_classifies(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = _classifier_dir(model_dirs["tiny-qwen2"], tmp_path / "served", labels=1)
    config = engine_config(str(path), max_model_len=128, kv_cache_gb=0.01, device=DEVICE)
    with _serving(path, "ranker") as url:
        offline = LLM.from_config(config, load_configured_model(config.model))
        expected = [r.outputs.score for r in offline.score(QUERY, DOCUMENTS)]
        offline.close()
        scored = httpx.post(f"{url}/score", json={"model": "ranker", "text_1": QUERY, "text_2": DOCUMENTS})
        assert scored.status_code == 200, scored.text
        assert [d["score"] for d in scored.json()["data"]] == pytest.approx(expected, abs=1e-5)
        for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
            body = {"model": "ranker", "query": QUERY, "documents": DOCUMENTS, "top_n": 2}
            reranked = httpx.post(f"{url}{route}", json=body).json()
            order = sorted(range(3), key=lambda i: -expected[i])[:2]
            assert [r["index"] for r in reranked["results"]] == order
            assert reranked["results"][0]["document"]["text"] == DOCUMENTS[order[0]]
            assert reranked["results"][0]["relevance_score"] == pytest.approx(expected[order[0]], abs=1e-5)
        classified = httpx.post(f"{url}/classify", json={"model": "ranker", "input": ["Hello", "Bye"]}).json()
        assert [d["num_classes"] for d in classified["data"]] == [1, 1] and classified["data"][0]["label"] == "class-0"
        newer = httpx.post(f"{url}/score", json={"queries": QUERY, "documents": DOCUMENTS})  # (no model: served)
        assert [d["score"] for d in newer.json()["data"]] == pytest.approx(expected, abs=1e-5)
        embedded = httpx.post(f"{url}/v1/embeddings", json={"model": "ranker", "input": "x"})
        assert embedded.status_code == 400 and "is a classifier" in embedded.json()["error"]["message"]
        bad = httpx.post(f"{url}/score", json={"model": "ranker", "text_1": ["a", "b"], "text_2": DOCUMENTS})
        assert bad.status_code == 400 and "text_1 holds 2 texts" in bad.json()["error"]["message"]


def test_the_server_classifies_into_three_labels(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = _classifier_dir(model_dirs["tiny-qwen2"], tmp_path / "three-served", labels=3)
    with _serving(path, "cls") as url:
        prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
        reply = httpx.post(f"{url}/classify", json={"model": "cls", "input": prompts}).json()
        for item, logits in zip(reply["data"], _hf_logits(path, prompts), strict=True):
            probs = torch.softmax(logits, dim=-1)
            assert item["probs"] == pytest.approx(probs.tolist(), abs=1e-5)
            assert item["label"] == f"class-{int(probs.argmax())}" and item["num_classes"] == 3
        assert reply["usage"]["prompt_tokens"] == 10


def test_an_embedding_model_refuses_scoring_routes(model_dirs: dict[str, Path]) -> None:
    with _serving(model_dirs["tiny-llama"], "tiny") as url:
        reply = httpx.post(f"{url}/rerank", json={"model": "tiny", "query": "q", "documents": ["d"]})
        assert reply.status_code == 400 and "is no classifier" in reply.json()["error"]["message"]


def test_labels_come_from_the_config(tmp_path: Path) -> None:
    from boundless.model.classifier import classifier_spec

    spec = classifier_spec({"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "no", "1": "yes"}})
    assert spec is not None and spec.labels == ("no", "yes") and spec.from_tokens is None
    assert classifier_spec({"architectures": ["LlamaForCausalLM"]}) is None
    tokens = classifier_spec({"classifier_from_token": ["no", "yes"]})
    assert tokens is not None and tokens.labels == ("yes",) and tokens.from_tokens == ("no", "yes")
    assert json.dumps(spec.labels)  # (plain strings, for the API's label)
