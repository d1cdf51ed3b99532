"""Embedding requests (``SamplingParams.embed``, ``LLM.embed``): a prompt's last hidden state after the final norm,
pooled as the model's directory says, equals transformers' (``AutoModel``'s ``last_hidden_state``), with the prefix
cache, in chunks, on two tensor-parallel ranks, and from a base model saved alone (an embedding model's checkpoint)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from boundless.engine.errors import InvalidRequestError
from boundless.llm import LLM
from boundless.model.random_model import TinySpec, write_random_model

# BOUNDLESS_TEST_DEVICE=cuda runs them on a GPU (scripts/gpu-check.sh), against transformers on the CPU.
DEVICE = os.environ.get("BOUNDLESS_TEST_DEVICE", "cpu")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40, 41]]


def _reference(path: Path, prompts: list[list[int]], normalize: bool = True, mean: bool = False) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(path), torch_dtype=torch.float32)
    with torch.inference_mode():
        states = [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    pooled = [h.mean(dim=0) if mean else h[-1] for h in states]
    return [torch.nn.functional.normalize(h, dim=-1) if normalize else h for h in pooled]


def _sentence_transformers(path: Path, pooling: str, normalize: bool) -> Path:
    """Give the model directory sentence-transformers' modules: a Pooling module of ``pooling``, and Normalize."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, pooling: True}))
    return path


def _close(got: list[list[float]], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for vector, reference in zip(got, expected, strict=True):
        assert torch.allclose(torch.tensor(vector), reference, atol=1e-4), (vector[:4], reference[:4])


def test_embeddings_are_transformers_last_hidden_states_normalized(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["tiny-qwen3"]
    expected = _reference(path, PROMPTS)
    llm = LLM(str(path), max_model_len=256, kv_cache_gb=0.01, device=DEVICE)
    try:
        first = llm.embed(PROMPTS)
        _close([r.outputs.embedding for r in first], expected)
        assert [r.prompt_token_ids for r in first] == PROMPTS and all(r.finished for r in first)
        assert abs(torch.tensor(first[0].outputs.embedding).norm().item() - 1) < 1e-5
        assert llm.engine.counters.generation_tokens == 0  # (the token each samples is no answer)
        again = llm.embed([PROMPTS[1]])  # its first block in the prefix cache: the rest is computed, the same vector
        assert llm.engine.stats().prefix_cache_hit_rate > 0
        _close([again[0].outputs.embedding], expected[1:2])
        # Text is tokenized as generate tokenizes it; generation still runs beside embeddings.
        text = llm.embed("The quick brown fox")[0]
        assert text.prompt_token_ids == llm.get_tokenizer().encode("The quick brown fox")
        assert llm.generate([PROMPTS[0]])[0].outputs[0].token_ids
    finally:
        llm.close()


def test_embeddings_in_chunks_of_a_few_tokens_are_the_same(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["tiny-llama"]
    llm = LLM(
        str(path),
        max_model_len=256,
        kv_cache_gb=0.01,
        device=DEVICE,
        max_num_batched_tokens=5,
        enable_prefix_caching=False,
    )
    try:
        _close([r.outputs.embedding for r in llm.embed(PROMPTS)], _reference(path, PROMPTS))
    finally:
        llm.close()


@pytest.mark.parametrize(
    "options",
    [
        {"num_scheduler_steps": 4},
        {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'},
        {"num_kv_blocks": 9, "max_num_batched_tokens": 8},
    ],
    ids=["multi-step", "ngram", "preempting"],
)
def test_embeddings_among_generations_are_the_same(options: dict, model_dirs: dict[str, Path]) -> None:
    """Embedding requests arriving while others generate, in multi-step windows, with n-gram drafts, or preempted in
    a small pool: a one-token prompt, and one whose blocks are all in the prefix cache, among them."""
    from boundless.engine.core import EngineCore
    from boundless.engine.sampling_params import SamplingParams
    from boundless.llm import engine_config
    from boundless.model.loader import load_configured_model

    path = model_dirs["tiny-llama"]
    embeds = [[7], list(range(20, 52)), [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]
    config = engine_config(str(path), max_model_len=128, device=DEVICE, **{"kv_cache_gb": 0.01, **options})
    core = EngineCore.from_model(load_configured_model(config.model), config)
    try:
        generate = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        core.add_request("g0", [3, 4, 5, 6] * 8, generate)
        core.add_request("g1", list(range(100, 130)), generate)
        core.add_request("warm", embeds[1], SamplingParams(temperature=0.0, max_tokens=1))  # (its blocks cached)
        got: dict[str, list[float]] = {}
        steps = 0
        while core.has_unfinished():
            if steps == 3:
                for j, prompt in enumerate(embeds):
                    core.add_request(f"e{j}", prompt, SamplingParams(temperature=0.0, max_tokens=1, embed=True))
            for delta in core.step():
                if delta.embedding is not None:
                    got[delta.request_id] = delta.embedding
            steps += 1
        # (The engine hands back the pooled state; its reader normalizes it: EmbeddingPooling.embedding.)
        _close([got[f"e{j}"] for j in range(len(embeds))], _reference(path, embeds, normalize=False))
    finally:
        core.close()


def test_a_mean_pooled_prompt_beside_preemptions_counts_each_token_once(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """A pool of four blocks: a generation and an embedding request's prompt in chunks of 8 run out of room (a request
    is preempted), and the mean is of each prompt token once."""
    from boundless.engine.core import EngineCore
    from boundless.engine.sampling_params import SamplingParams
    from boundless.llm import engine_config
    from boundless.model.loader import load_configured_model

    mean = _sentence_transformers(
        Path(shutil.copytree(model_dirs["tiny-llama"], tmp_path / "mean")), "pooling_mode_mean_tokens", normalize=True
    )
    config = engine_config(
        str(mean), max_model_len=64, kv_cache_gb=0.01, num_kv_blocks=4, max_num_batched_tokens=8, policy="fcfs"
    )
    core = EngineCore.from_model(load_configured_model(config.model), config)
    prompt = list(range(30, 70))
    try:
        core.add_request("g", list(range(10, 20)), SamplingParams(temperature=0, max_tokens=45, ignore_eos=True))
        got, steps = None, 0
        while core.has_unfinished():
            if steps == 5:
                core.add_request("e", prompt, SamplingParams(temperature=0, max_tokens=1, embed=True))
            for delta in core.step():
                got = delta.embedding if delta.embedding is not None else got
            steps += 1
        assert core.stats().num_preemptions >= 1 and got is not None
        _close([got], _reference(mean, [prompt], normalize=False, mean=True))  # (the pooled state, not normalized)
    finally:
        core.close()


def test_a_prompt_computed_again_from_its_start_begins_its_mean_anew() -> None:
    """Preempted and recomputed, a prompt's chunk from position 0 replaces what mean pooling had added up of it."""
    from types import SimpleNamespace

    from boundless.engine.runner import ModelRunner

    runner = SimpleNamespace(_pool_sums={})
    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)

    def chunk(start: int) -> SimpleNamespace:
        return SimpleNamespace(request_id="e", start_pos=start)

    ModelRunner._add_to_means(runner, hidden, [(chunk(0), 0, 2)])  # type: ignore[arg-type]
    ModelRunner._add_to_means(runner, hidden, [(chunk(2), 2, 4)])  # type: ignore[arg-type]
    ModelRunner._add_to_means(runner, hidden, [(chunk(0), 0, 3)])  # type: ignore[arg-type]  # (computed again)
    total, count = runner._pool_sums["e"]
    assert count == 3 and torch.equal(total, hidden[:3].sum(dim=0))


def test_the_model_directorys_pooling_is_read(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """sentence-transformers' modules: last-token pooling without Normalize gives the raw hidden state; CLS pooling is
    refused for what it is (last-token and mean pooling are served)."""
    raw = _sentence_transformers(
        Path(shutil.copytree(model_dirs["tiny-llama"], tmp_path / "raw")), "pooling_mode_lasttoken", normalize=False
    )
    llm = LLM(str(raw), max_model_len=256, kv_cache_gb=0.01, device=DEVICE)
    try:
        _close([r.outputs.embedding for r in llm.embed(PROMPTS)], _reference(raw, PROMPTS, normalize=False))
    finally:
        llm.close()
    cls = _sentence_transformers(
        Path(shutil.copytree(model_dirs["tiny-llama"], tmp_path / "cls")), "pooling_mode_cls_token", normalize=True
    )
    llm = LLM(str(cls), max_model_len=256, kv_cache_gb=0.01, device=DEVICE)
    try:
        with pytest.raises(InvalidRequestError, match=r"pool by .cls.* last-token and mean pooling are served"):
            llm.embed(PROMPTS)
    finally:
        llm.close()


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 5}], ids=["whole", "chunks-of-5"])
def test_mean_pooling_averages_every_prompt_tokens_hidden_state(
    options: dict, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """A model whose modules pool by mean (LLM2Vec's, jina's): the mean of every prompt token's last hidden state, as
    its chunks run, its blocks never taken from the prefix cache (their hidden states are not kept), through
    preemption and recompute (below)."""
    mean = _sentence_transformers(
        Path(shutil.copytree(model_dirs["tiny-llama"], tmp_path / "mean")), "pooling_mode_mean_tokens", normalize=True
    )
    llm = LLM(str(mean), max_model_len=64, device=DEVICE, **{"kv_cache_gb": 0.01, **options})
    try:
        expected = _reference(mean, PROMPTS, mean=True)
        _close([r.outputs.embedding for r in llm.embed(PROMPTS)], expected)
        llm.generate([PROMPTS[1]])  # its blocks now cached: the embedding computes them again all the same
        _close([llm.embed([PROMPTS[1]])[0].outputs.embedding], expected[1:2])
    finally:
        llm.close()


def test_a_base_model_saved_alone_loads_and_embeds_as_transformers(tmp_path: Path) -> None:
    """An embedding model's checkpoint, as Qwen3-Embedding's: the base model's tensors without the ``model.`` prefix
    (``Qwen3Model.save_pretrained``), the head tied to the embedding."""
    from transformers import AutoModel

    causal = write_random_model(
        tmp_path / "causal", TinySpec(kind="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True)
    )
    base = tmp_path / "base"
    AutoModel.from_pretrained(str(causal), torch_dtype=torch.float32).save_pretrained(str(base))
    for tokenizer_file in causal.glob("tokenizer*"):
        shutil.copy(tokenizer_file, base)
    from safetensors import safe_open

    with safe_open(str(next(base.glob("*.safetensors"))), framework="pt") as f:
        assert not any(k.startswith("model.") for k in f.keys())  # noqa: SIM118 (the shape an embedding model has)
    llm = LLM(str(base), max_model_len=256, kv_cache_gb=0.01, device=DEVICE)
    try:
        _close([r.outputs.embedding for r in llm.embed(PROMPTS)], _reference(causal, PROMPTS))
    finally:
        llm.close()


def test_a_base_model_saved_with_no_head_embeds_and_refuses_to_generate(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """e5-mistral's shape: the base model alone, its head neither tied nor saved."""
    from transformers import AutoModel

    base = tmp_path / "headless"
    AutoModel.from_pretrained(str(model_dirs["tiny-llama"]), torch_dtype=torch.float32).save_pretrained(str(base))
    for tokenizer_file in model_dirs["tiny-llama"].glob("tokenizer*"):
        shutil.copy(tokenizer_file, base)
    llm = LLM(str(base), max_model_len=256, kv_cache_gb=0.01, device=DEVICE)
    try:
        _close([r.outputs.embedding for r in llm.embed(PROMPTS)], _reference(model_dirs["tiny-llama"], PROMPTS))
        with pytest.raises(InvalidRequestError, match=r"is an embedding model .*no LM head"):
            llm.generate([PROMPTS[0]])
    finally:
        llm.close()


def test_pooling_params_cut_a_matryoshka_models_embeddings(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    from boundless import PoolingParams

    path = Path(shutil.copytree(model_dirs["tiny-llama"], tmp_path / "m"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    llm = LLM(str(path), max_model_len=256, kv_cache_gb=0.01, device=DEVICE)
    try:
        whole = llm.embed(PROMPTS[:1])[0].outputs.embedding
        cut = llm.embed(PROMPTS[:1], pooling_params=PoolingParams(dimensions=16))[0].outputs
        assert cut.hidden_size == 16 and abs(torch.tensor(cut.embedding).norm().item() - 1) < 1e-5
        assert torch.allclose(
            torch.tensor(cut.embedding), torch.nn.functional.normalize(torch.tensor(whole[:16]), dim=-1)
        )
        raw = llm.embed(PROMPTS[:1], pooling_params=PoolingParams(normalize=False))[0].outputs.embedding
        _close([raw], _reference(path, PROMPTS[:1], normalize=False))  # (vLLM's normalize: a request's own choice)
        with pytest.raises(ValueError, match=r"trained for: \[16, 32\], not 20"):
            llm.embed(PROMPTS[:1], pooling_params=PoolingParams(dimensions=20))
    finally:
        llm.close()


def test_a_split_model_embeds_as_one_device(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["tiny-llama"]
    llm = LLM(str(path), max_model_len=256, kv_cache_gb=0.01, tensor_parallel_size=2)  # (two ranks: the CPU)
    try:
        _close([r.outputs.embedding for r in llm.embed(PROMPTS)], _reference(path, PROMPTS))
    finally:
        llm.close()
