"""Boundless computes what Hugging Face transformers computes on the same weights.

For the bundled SmolLM2 GGUF and random tiny models (a Llama with GQA and llama3 rope scaling, a Qwen2 with q/k/v
biases and untied embeddings, a Qwen3 with its norm of each q and k head, a Qwen3-MoE with sparse and dense layers;
further below Mixtral, Phi-3, YaRN, sliding windows and Gemma 3): greedy outputs of 8+ prompts of mixed lengths run
together are token-for-token those of ``transformers``, with prefix caching on and off, with chunked prefill under a
tiny token budget and under forced preemption, and with prefixes that come back from host memory or from the disk
store; per-step logits agree within 1e-3, and so do prompt logprobs with transformers' log-softmax of each prompt
position.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from model_files import add_bpe_vocabulary, add_shape, step_logits

from boundless.attention import triton_paged
from boundless.bench.offline import load_hf_reference
from boundless.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.builder import ModelIdentity, build_model_executor, size_engine
from boundless.engine.core import EngineCore
from boundless.engine.logprobs import PositionLogprobs
from boundless.engine.sampling_params import SamplingParams
from boundless.kv.tensors import PagedKVCache
from boundless.kv.transfer import DISK, HOST
from boundless.llm import LLM, engine_config
from boundless.model.loader import LoadedModel, load_model
from boundless.model.random_model import TinySpec, write_random_model

MAX_NEW = 12
MODELS = ["smollm2-135m", "tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"]

# Mixed lengths, with shared prefixes (so the prefix cache has something to find).
TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "The quick brown fox jumps over the lazy dog. Then it ran into the forest and",
    "Agents call language models many times in a loop, with tools between the calls. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Numbers like 12, 345 and 6789",
    "Agents call language models many times in a loop, with tools between the calls. " * 3 + "Why?",
    "A long context holds a whole conversation, and the cache keeps its keys and values. " * 4,
    "Paris",
]


class Reference:
    """Greedy tokens and per-step logits of transformers, one prompt at a time (no padding)."""

    def __init__(self, loaded: LoadedModel, model: Any, texts: list[str] = TEXTS) -> None:
        self.loaded = loaded
        self.prompts = [loaded.tokenizer.encode(t) for t in texts]
        self.tokens: list[list[int]] = []
        self.logits: list[torch.Tensor] = []
        with torch.inference_mode():
            for p in self.prompts:
                out = model.generate(
                    torch.tensor([p], device=loaded.device),
                    attention_mask=torch.ones(1, len(p), dtype=torch.long, device=loaded.device),
                    max_new_tokens=MAX_NEW,
                    min_new_tokens=MAX_NEW,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
                self.tokens.append(out.sequences[0, len(p) :].tolist())
                self.logits.append(torch.cat(out.logits).float().cpu())


_REFERENCES: dict[str, Reference] = {}


def _reference(name: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]) -> Reference:
    if name not in _REFERENCES:
        _REFERENCES[name] = Reference(load(name), hf_model(name))
    return _REFERENCES[name]


@pytest.fixture(scope="module", params=MODELS)
def ref(
    request: pytest.FixtureRequest, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> Reference:
    return _reference(request.param, load, hf_model)


def _engine(loaded: LoadedModel, **cache_and_sched) -> EngineCore:
    cache_keys = ("num_kv_blocks", "enable_prefix_caching", "block_size", "swap_space_gb")
    cache = {k: v for k, v in cache_and_sched.items() if k in cache_keys}
    sched_keys = ("max_num_batched_tokens", "num_scheduler_steps", "speculative_config")
    sched = {k: v for k, v in cache_and_sched.items() if k in sched_keys}
    model = {k: v for k, v in cache_and_sched.items() if k in ("attention_backend", "enforce_eager")}
    cfg = EngineConfig(
        # 512 tokens, or the model's context where shorter (tiny-qwen3-yarn's: 128).
        model=ModelConfig(
            # (None: the engine's own, from the model and the pool.)
            max_model_len=cache_and_sched.get("max_model_len", min(512, loaded.arch.context_length)),
            **model,
        ),
        cache=CacheConfig(**cache),
        scheduler=SchedulerConfig(**sched),
    )
    return EngineCore.from_model(loaded, cfg)


# The reference's greedy tokens: exactly MAX_NEW, the end of the sequence held back until then (transformers'
# min_new_tokens, the engine's min_tokens, which forbids the end tokens unless ignore_eos: a model that would end there
# picks its next choice in both).
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)


def _run_greedy(
    core: EngineCore, prompts: list[list[int]], tag: str = "", params: SamplingParams = GREEDY
) -> list[list[int]]:
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}{i}", p, params)
    out: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for delta in core.step():
            out[delta.request_id].extend(delta.new_token_ids)
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


def _pool_for_preemption(prompts: list[list[int]], block_size: int) -> tuple[int, int]:
    """A pool that fits the longest request but not all of them at once."""
    longest = max(len(p) for p in prompts) + MAX_NEW
    blocks = -(-longest // block_size) + 2
    return blocks, blocks * block_size


CONFIGS = {
    "prefix-cache": {"enable_prefix_caching": True},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked-prefill": {"max_num_batched_tokens": 7},
    "preemption-swap": {"preempt": True},
    "preemption-recompute": {"preempt": True, "swap_space_gb": 0.0},
    # n-gram drafts checked in one pass (engine/speculative.py): greedy output must not change.
    "speculative": {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'},
    # Suffix decoding's drafts (engine/suffix_decoding.py), up to 8 a step; the prompts run twice, the second time
    # drafted from the first time's outputs.
    "suffix-decoding": {"speculative_config": '{"method": "suffix", "num_speculative_tokens": 8}'},
}


# SmolLM2's preemption cases (~3-4 s each here) are in the slow suite; its other cases and the tiny models' preemption
# cases stay in the fast one.
_SLOW_SMOLLM2 = ("preemption-swap", "preemption-recompute")
GREEDY_PARAMS = [
    pytest.param(name, config, marks=pytest.mark.slow if name == "smollm2-135m" and config in _SLOW_SMOLLM2 else ())
    for name in MODELS
    for config in CONFIGS
]


@pytest.mark.parametrize(
    "name",
    [
        "tiny-mixtral",
        "tiny-phi3",
        "tiny-qwen3-yarn",
        "tiny-granite",
        "tiny-glm4",
        "tiny-gpt-oss-mxfp4",
        "tiny-smollm3",
        "tiny-glm4-moe",
    ],
)
def test_more_architectures_greedy_match_transformers(
    name: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """Mixtral (the same mixture of experts as Qwen3-MoE's, under its own names, in every layer), Phi-3 (a Llama
    whose checkpoint fuses q/k/v and gate/up), a Qwen3 with YaRN RoPE scaling, Granite (its multipliers) and GLM-4
    (its interleaved RoPE on half of each head, four norms a layer), gpt-oss from MXFP4 experts and SmolLM3 (a layer
    without RoPE), in one batch with prefix caching; the other configurations run on the architectures above."""
    ref = _reference(name, load, hf_model)
    assert _run_greedy(_engine(ref.loaded), ref.prompts) == ref.tokens


@pytest.mark.parametrize(("name", "renamed"), [("tiny-qwen3-moe", "num_local_experts"), ("tiny-gemma3", "layer_types")])
def test_a_config_saved_by_transformers_5_matches_transformers(
    name: str,
    renamed: str,
    load: Callable[[str], LoadedModel],
    hf_model: Callable[[str], Any],
    model_dirs: dict[str, Path],
    tmp_path: Path,
) -> None:
    """The tiny models' weights under the config.json transformers 5 writes for them: Qwen3-MoE's experts as
    num_local_experts (read as a dense model, it was refused), RoPE in rope_parameters (Gemma 3's a kind of layer
    each, its windows' layers as layer_types): transformers' greedy tokens."""
    from transformers import AutoConfig

    ref = _reference(name, load, hf_model)
    path = shutil.copytree(model_dirs[name], tmp_path / "resaved")
    AutoConfig.from_pretrained(path).save_pretrained(path)
    assert renamed in json.loads((path / "config.json").read_text())
    assert _run_greedy(_engine(load_model(str(path), device=ref.loaded.device.type)), ref.prompts) == ref.tokens


@pytest.mark.parametrize(("ref", "config"), GREEDY_PARAMS, indirect=["ref"])
def test_greedy_matches_transformers(ref: Reference, config: str) -> None:
    options = dict(CONFIGS[config])
    if options.pop("preempt", False):
        blocks, max_len = _pool_for_preemption(ref.prompts, 16)
        options.update(num_kv_blocks=blocks, max_model_len=max_len)
    core = _engine(ref.loaded, **options)
    assert len(ref.prompts) >= 8 and len({len(p) for p in ref.prompts}) >= 6
    got = _run_greedy(core, ref.prompts)
    if config == "suffix-decoding":
        got += _run_greedy(core, ref.prompts, "again-")
    for i, (ours, theirs) in enumerate(zip(got, ref.tokens * (len(got) // len(ref.tokens)), strict=True)):
        n = i % len(ref.prompts)
        assert ours == theirs, f"prompt {n} ({len(ref.prompts[n])} tokens) diverges"
    stats = core.scheduler.stats
    if config == "prefix-cache":
        assert stats.num_prompt_tokens_cached > 0
    if config == "no-prefix-cache":
        assert stats.num_prompt_tokens_cached == 0
    if config == "preemption-swap":
        assert stats.num_swapped_out > 0 and stats.num_swapped_in > 0 and stats.num_recomputed == 0
    if config == "preemption-recompute":
        assert stats.num_recomputed > 0 and stats.num_swapped_out == 0
    if config == "chunked-prefill":
        assert core.counters.steps > sum(len(p) for p in ref.prompts) // 7
    if config == "speculative":
        assert core.counters.draft_tokens > 0  # drafts were checked (kept or not, the tokens are the same)
    if config == "suffix-decoding":
        assert core.counters.accepted_tokens >= 4 * len(ref.prompts)  # the second time's, from the first's outputs


# The GPU attention backend (CUDA's default). On the CPU it runs in Triton's interpreter, whose programs run one at a
# time, on the first three prompts (two tokens, and two that share a prefix: 19 s with all nine here), in prefill
# chunks of 16 tokens (chunks of one prompt, and of two beside each other, as the nine took in chunks of 64):
# tiny-llama (grouped-query heads, llama3 rope scaling) in the fast suite, so that the default GPU path's outputs are
# checked against transformers on every change; tiny-qwen2 (a kv head per head), tiny-qwen3 (its head norm), the MoE
# model and the rest in the slow one; smollm2 not at all (30 layers). The kernels' own tests against dense attention
# run in the fast suite, in the interpreter too (tests/attention/test_triton_paged.py, both head layouts). On CUDA
# every model runs, on every prompt (scripts/gpu-check.sh).
_ON_CPU = os.environ.get("BOUNDLESS_TEST_DEVICE", "cpu") == "cpu"  # (conftest's TEST_DEVICE)
TRITON_MODELS = [
    "tiny-llama",
    pytest.param("tiny-qwen2", marks=pytest.mark.slow if _ON_CPU else ()),
    pytest.param("tiny-qwen3", marks=pytest.mark.slow if _ON_CPU else ()),
    pytest.param("tiny-qwen3-moe", marks=pytest.mark.slow if _ON_CPU else ()),
    # (The rest, 13-21 s each in the interpreter, in the slow suite on the CPU, for make test's 10 minutes: a sliding
    # window on every layer, the kernel's window tiles; Gemma 3's norms of each output, its GELU, a RoPE table a kind
    # of layer; Gemma 2's capped scores; Granite's multiplied products and softmax scale; GLM-4's norms of the
    # products, RoPE on half of each head. The kernels' own tests of windows and capped scores run in the fast suite.)
    pytest.param("tiny-mistral-window", marks=pytest.mark.slow if _ON_CPU else ()),
    pytest.param("tiny-qwen2-window", marks=pytest.mark.slow if _ON_CPU else ()),
    pytest.param("tiny-gemma3", marks=pytest.mark.slow if _ON_CPU else ()),
    pytest.param("tiny-gemma2", marks=pytest.mark.slow if _ON_CPU else ()),
    pytest.param("tiny-granite", marks=pytest.mark.slow if _ON_CPU else ()),
    pytest.param("tiny-glm4", marks=pytest.mark.slow if _ON_CPU else ()),
    # (The sinks merged with the kernels' log-sum-exp, 11 s here; a layer the fused path leaves unrotated, 16 s: the
    # slow suite on the CPU.)
    pytest.param("tiny-gpt-oss", marks=pytest.mark.slow if _ON_CPU else ()),
    pytest.param("tiny-smollm3", marks=pytest.mark.slow if _ON_CPU else ()),
    pytest.param("tiny-glm4-moe", marks=pytest.mark.slow if _ON_CPU else ()),  # (its routing on the GPU path)
    "smollm2-135m",
]


@pytest.mark.parametrize("name", TRITON_MODELS)
def test_greedy_matches_transformers_on_the_triton_kernels(
    name: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    loaded = load(name)
    if not triton_paged.available(loaded.device):
        pytest.skip("triton unavailable")
    if loaded.device.type == "cpu" and name == "smollm2-135m":
        pytest.skip("30 layers in Triton's interpreter: too slow for the CPU")
    ref = _reference(name, load, hf_model)
    on_cpu = loaded.device.type == "cpu"
    core = _engine(loaded, attention_backend="triton", max_num_batched_tokens=16 if on_cpu else 64)
    count = 3 if on_cpu else len(ref.prompts)
    got = _run_greedy(core, ref.prompts[:count])
    for i, (ours, theirs) in enumerate(zip(got, ref.tokens[:count], strict=True)):
        assert ours == theirs, f"prompt {i} ({len(ref.prompts[i])} tokens) diverges"


# FlexAttention (``--attention-backend flex``): on the CPU its eager reference scores every query against the whole
# pool, so the pool is kept just large enough for the prompts; on CUDA it runs compiled (scripts/gpu-check.sh).
# (On the CPU the fast suite runs the models whose attention Flex takes otherwise: windows, capped scores, sinks,
# Gemma 3's kinds of layer; the others' layers, 2-3 s each here, are the native path's in the fast suite and Flex's in
# the slow one.)
_SLOW_ON_CPU = pytest.mark.slow if _ON_CPU else ()
FLEX_MODELS = [
    "tiny-llama",
    pytest.param("tiny-qwen2", marks=_SLOW_ON_CPU),
    pytest.param("tiny-qwen3", marks=_SLOW_ON_CPU),
    pytest.param("tiny-qwen3-moe", marks=_SLOW_ON_CPU),
    "tiny-mistral-window",  # (each window's block mask)
    "tiny-qwen2-window",
    "tiny-gemma3",
    "tiny-gemma2",  # (its cap of the scores, a score_mod)
    pytest.param("tiny-granite", marks=_SLOW_ON_CPU),
    pytest.param("tiny-glm4", marks=_SLOW_ON_CPU),
    "tiny-gpt-oss",
    pytest.param("tiny-smollm3", marks=_SLOW_ON_CPU),
    pytest.param("tiny-glm4-moe", marks=_SLOW_ON_CPU),
    pytest.param("smollm2-135m", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name", FLEX_MODELS)
def test_greedy_matches_transformers_on_flex_attention(
    name: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    _check_flex(_reference(name, load, hf_model), max_num_batched_tokens=64)


@pytest.mark.parametrize("config", ["chunked-prefill", "speculative", "preemption-recompute"])
def test_flex_attention_matches_transformers_under_the_engines_configurations(
    config: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """Chunks of 7 tokens over cached prefixes, drafts checked in one pass (several query tokens over a cached
    context) and requests preempted and recomputed, on tiny-llama."""
    ref = _reference("tiny-llama", load, hf_model)
    core = _check_flex(ref, **CONFIGS[config])
    stats, counters = core.scheduler.stats, core.counters
    assert {
        "chunked-prefill": counters.steps > sum(len(p) for p in ref.prompts) // 7,
        "speculative": counters.draft_tokens > 0,
        "preemption-recompute": stats.num_recomputed > 0,
    }[config]


def _check_flex(ref: Reference, **options: Any) -> EngineCore:
    """The engine on FlexAttention gives transformers' greedy tokens; returns it."""
    block_size = 16
    if options.pop("preempt", False):
        blocks, max_len = _pool_for_preemption(ref.prompts, block_size)
    else:
        # (_engine's --max-model-len, which the pool must hold)
        max_len = options.pop("max_model_len", min(512, ref.loaded.arch.context_length))
        # All prompts at once and no more: the CPU's eager reference scores every query against the whole pool.
        blocks = max(sum(-(-(len(p) + MAX_NEW) // block_size) for p in ref.prompts), max_len // block_size) + 4
    options.setdefault("max_num_batched_tokens", 64)
    core = _engine(
        ref.loaded, attention_backend="flex", num_kv_blocks=blocks, block_size=block_size, max_model_len=max_len,
        **options,
    )  # fmt: skip
    got = _run_greedy(core, ref.prompts)
    for i, (ours, theirs) in enumerate(zip(got, ref.tokens, strict=True)):
        assert ours == theirs, f"prompt {i} ({len(ref.prompts[i])} tokens) diverges"
    return core


def test_per_step_logits_match_transformers(ref: Reference) -> None:
    _check_per_step_logits(ref)


WINDOW_MODELS = ["tiny-mistral-window", "tiny-qwen2-window", "tiny-gemma3", "tiny-gemma2"]


@pytest.mark.parametrize("config", ["prefix-cache", "chunked-prefill", "preemption-recompute", "speculative"])
@pytest.mark.parametrize("name", WINDOW_MODELS)
def test_sliding_window_models_greedy_match_transformers(
    name: str, config: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """Models whose layers attend within a sliding window (a Mistral's every layer, a Qwen2's after its first, a
    Gemma 3's and a Gemma 2's but every second), past the window: transformers' greedy tokens, under the engine's
    configurations (a chunk, a decode, a verify pass, a recomputed prefix each over a window that ends inside a
    block)."""
    ref = _reference(name, load, hf_model)
    window = ref.loaded.arch.sliding_window
    assert window is not None and sum(len(p) > window for p in ref.prompts) >= 5
    test_greedy_matches_transformers(ref, config)


@pytest.mark.parametrize("budget", [32, 7])
def test_a_window_models_blocks_past_the_window_go_back_to_the_pool(
    budget: int, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """Every layer of the Mistral slides (12 keys): a pool of 5 blocks (80 tokens) serves its prompts of up to 116
    tokens and their outputs, longer than the pool, as transformers does: the blocks each request's window has left
    go back to the pool when it runs short (before anyone is preempted), where they stay named. A model with a layer
    over the whole context keeps its context within the pool."""
    ref = _reference("tiny-mistral-window", load, hf_model)
    assert max(len(p) for p in ref.prompts) + MAX_NEW > 5 * 16
    core = _engine(ref.loaded, num_kv_blocks=5, max_model_len=None, max_num_batched_tokens=budget)
    assert core.max_model_len == ref.loaded.arch.context_length and core.kv.window == 12
    # Twice: the second time each prompt's prefix comes back from host memory, copies the step still makes into blocks
    # a release must not give back in the same step.
    got = _run_greedy(core, ref.prompts) + _run_greedy(core, ref.prompts, "again-")
    for i, (ours, theirs) in enumerate(zip(got, ref.tokens * 2, strict=True)):
        n = i % len(ref.prompts)
        assert ours == theirs, f"prompt {n} ({len(ref.prompts[n])} tokens) diverges"
    assert core.stats().window_blocks_released == core.scheduler.stats.num_window_blocks_released > 0  # (/metrics')
    assert core.kv.pool.num_used == 0  # (every request's blocks freed: the released ones as they went, once)
    qwen2 = _engine(_reference("tiny-qwen2-window", load, hf_model).loaded, num_kv_blocks=5, max_model_len=None)
    assert qwen2.max_model_len == 5 * 16 and qwen2.kv.window is None


def test_a_conversation_longer_than_the_pool_comes_back_from_its_window_on(
    load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """An agent's next call sends its conversation again: past the pool, its prefix in memory (host memory's, here)
    is taken from the window of its next token on, the blocks before it skipped, not cut at the pool and computed
    again; its answer is the one an engine with room for everything gives."""
    loaded = _reference("tiny-mistral-window", load, hf_model).loaded
    first = loaded.tokenizer.encode(TEXTS[7] * 2)[:150]
    core = _engine(loaded, num_kv_blocks=5, max_model_len=None, max_num_batched_tokens=32)
    (answer,) = _run_greedy(core, [first])
    again = first + answer + loaded.tokenizer.encode(" And then?")
    cached = core.scheduler.stats.num_prompt_tokens_cached
    (ours,) = _run_greedy(core, [again], "again-")
    assert core.scheduler.stats.num_prompt_tokens_cached - cached >= 144 > 5 * 16  # (9 blocks, past the pool's 5)
    (roomy,) = _run_greedy(_engine(loaded, num_kv_blocks=40, max_model_len=None), [again])
    assert ours == roomy


@pytest.mark.parametrize("name", WINDOW_MODELS)
def test_sliding_window_per_step_logits_match_transformers_and_the_window_counts(
    name: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """Per-step logits within 1e-3 of transformers'; and the same layers over the whole context give other tokens
    (the test would pass without windows otherwise)."""
    ref = _reference(name, load, hf_model)
    _check_per_step_logits(ref)
    layers = list(ref.loaded.model.layers)
    windows = [layer.window for layer in layers]
    assert any(w is None for w in windows) == (name != "tiny-mistral-window")  # (Qwen2's first layer: the whole)
    try:
        for layer in layers:
            layer.window = None
        assert _run_greedy(_engine(ref.loaded), ref.prompts) != ref.tokens
    finally:
        for layer, window in zip(layers, windows, strict=True):
            layer.window = window


@pytest.mark.parametrize("part", ["local_rope", "gelu", "attn_out_norm", "mlp_out_norm"])
def test_each_part_of_gemma3_counts(
    part: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """Gemma 3's own parts (its sliding-window layers' RoPE base, the GELU, the norms of attention's and the MLP's
    outputs): the per-step logits match transformers' with them (test_sliding_window_per_step_logits_...) and not
    without any one of them, so none goes unchecked."""
    ref = _reference("tiny-gemma3", load, hf_model)
    assert sum(len(set(tokens)) for tokens in ref.tokens) > 3 * len(ref.tokens)  # (not one token over and over)
    layers = list(ref.loaded.model.layers)
    kept = [getattr(layer, part) for layer in layers]
    assert any(kept)
    try:
        for layer in layers:
            setattr(layer, part, False if isinstance(getattr(layer, part), bool) else None)
        with pytest.raises(AssertionError, match="largest logit difference"):
            _check_per_step_logits(ref)
    finally:
        for layer, value in zip(layers, kept, strict=True):
            setattr(layer, part, value)


@pytest.mark.parametrize("part", ["attn_logit_softcap", "final_logit_softcap", "gelu", "attn_out_norm"])
def test_each_part_of_gemma2_counts(
    part: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """Gemma 2's own parts beside Gemma 3's (the caps of attention's scores and of the logits; its GELU and its norms
    of the outputs, which it shares): the per-step logits match transformers' with them and not without any one."""
    ref = _reference("tiny-gemma2", load, hf_model)
    assert sum(len(set(tokens)) for tokens in ref.tokens) > 3 * len(ref.tokens)  # (not one token over and over)
    model, arch = ref.loaded.model, ref.loaded.arch
    layers = list(model.layers)
    kept = [getattr(layer, part, None) for layer in layers]
    try:
        if part in ("attn_logit_softcap", "final_logit_softcap"):  # (the engine's backend and the head read the arch)
            model.arch = dataclasses.replace(arch, **{part: None})
            changed = copy.copy(ref)
            changed.loaded = dataclasses.replace(ref.loaded, arch=model.arch)
        else:
            for layer in layers:
                setattr(layer, part, False if isinstance(getattr(layer, part), bool) else None)
            changed = ref
        with pytest.raises(AssertionError, match="largest logit difference"):
            _check_per_step_logits(changed)
    finally:
        model.arch = arch
        for layer, value in zip(layers, kept, strict=True):
            if value is not None:
                setattr(layer, part, value)


# LongRoPE and RoPE on part of each head (tiny-phi4-mini, over an original context of 48 positions). transformers
# rotates a forward pass by the long factors where its longest position is past the original context: the prompts
# within it (answers included) by the short ones, those past it by the long ones throughout. An engine picks once, by
# its context (vLLM's rule, rope.uses_long_factors): the short factors within the original context, else the long.
LONGROPE_CONTEXTS = {"short": 48, "long": 512}


def _longrope_reference(
    regime: str, hf_model: Callable[[str], Any], model_dirs: dict[str, Path], device: torch.device
) -> Reference:
    """transformers' tokens and logits of the prompts that stay within the original context (``short``) or start
    past it (``long``), with a model loaded for the regime's engines alone (a model prepared for one set of factors
    is refused by an engine of the other: ``LlamaModel.prepare``)."""
    key = f"tiny-phi4-mini:{regime}"
    if key not in _REFERENCES:
        loaded = load_model(str(model_dirs["tiny-phi4-mini"]), device=device.type)
        original = loaded.arch.rope_scaling.original_max_position_embeddings
        sizes = {t: len(loaded.tokenizer.encode(t)) for t in TEXTS}
        if regime == "short":
            texts = [t for t in TEXTS if sizes[t] + MAX_NEW <= original]
        else:
            texts = [t for t in TEXTS if sizes[t] > original]
        assert len(texts) >= 3
        _REFERENCES[key] = Reference(loaded, hf_model("tiny-phi4-mini"), texts)
    return _REFERENCES[key]


# (Triton's in its interpreter, 8-9 s each: the slow suite on the CPU.)
@pytest.mark.parametrize(
    "backend", ["native", pytest.param("triton", marks=pytest.mark.slow if _ON_CPU else ()), "flex"]
)
@pytest.mark.parametrize("regime", ["short", "long"])
def test_longrope_and_partial_rotary_match_transformers(
    regime: str,
    backend: str,
    load: Callable[[str], LoadedModel],
    hf_model: Callable[[str], Any],
    model_dirs: dict[str, Path],
) -> None:
    """Phi-4-mini's RoPE (its leading 3/4 of each head, LongRoPE's factors and attention factor): transformers'
    greedy tokens on each attention path, an engine within the original context on the prompts that stay in it and
    a longer one on those past it; on the default path the per-step logits too."""
    ref = _longrope_reference(regime, hf_model, model_dirs, load("tiny-llama").device)
    context = LONGROPE_CONTEXTS[regime]
    if backend == "native":
        _check_per_step_logits(ref, max_model_len=context)
        assert _run_greedy(_engine(ref.loaded, max_model_len=context, max_num_batched_tokens=7), ref.prompts) == (
            ref.tokens
        )
        return
    if backend == "flex":
        _check_flex(ref, max_model_len=context)
        return
    if not triton_paged.available(ref.loaded.device):
        pytest.skip("triton unavailable")
    core = _engine(ref.loaded, attention_backend=backend, max_model_len=context, max_num_batched_tokens=64)
    assert _run_greedy(core, ref.prompts) == ref.tokens


def test_longrope_factors_count(
    load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any], model_dirs: dict[str, Path]
) -> None:
    """The prompts within the original context, on an engine whose context asked for is longer (so rotated by the
    long factors, even where the pool holds less): transformers' logits (by the short ones) are not met, so the choice
    of factors is checked above. The model those engines ran on refuses an engine of the long factors, and the short
    engines' outputs are as they were."""
    ref = _longrope_reference("short", hf_model, model_dirs, load("tiny-llama").device)
    _check_per_step_logits(ref, max_model_len=LONGROPE_CONTEXTS["short"])
    with pytest.raises(ConfigError, match="prepared for LongRoPE's short factors"):
        _engine(ref.loaded, max_model_len=LONGROPE_CONTEXTS["long"])
    _check_per_step_logits(ref, max_model_len=LONGROPE_CONTEXTS["short"])
    long = copy.copy(ref)
    long.loaded = load_model(str(model_dirs["tiny-phi4-mini"]), device=ref.loaded.device.type)
    with pytest.raises(AssertionError, match="largest logit difference"):
        _check_per_step_logits(long, max_model_len=LONGROPE_CONTEXTS["long"])
    # (A pool of 48 tokens: the context asked for, not what the pool holds, picks the factors.)
    pooled = _engine(long.loaded, num_kv_blocks=3, block_size=16, max_model_len=None)
    assert pooled.layout.max_model_len == 48 and pooled.layout.rope_long


def test_the_long_factors_kv_is_named_otherwise(load: Callable[[str], LoadedModel]) -> None:
    """Keys rotated by LongRoPE's long factors are not the short factors': an engine past the original context names
    its blocks (the prefix cache's, the disk store's, a split's handoffs) otherwise than one within it; a model
    without LongRoPE names them the same whatever its context."""

    def identities(loaded: LoadedModel) -> list[ModelIdentity]:
        config = EngineConfig(cache=CacheConfig(num_kv_blocks=64, block_size=16))
        contexts = [dataclasses.replace(config, model=ModelConfig(max_model_len=n)) for n in LONGROPE_CONTEXTS.values()]
        layouts = [size_engine(c, loaded.arch, loaded.dtype) for c in contexts]
        assert [layout.rope_long for layout in layouts] == [False, loaded.arch.rope_scaling.kind == "longrope"]
        return [ModelIdentity.of(loaded, layout) for layout in layouts]

    phi4, llama = load("tiny-phi4-mini"), load("tiny-llama")
    short, long = identities(phi4)
    assert short.fingerprint == phi4.fingerprint != long.fingerprint == phi4.kv_fingerprint(True)
    assert [i.fingerprint for i in identities(llama)] == [llama.fingerprint] * 2


@pytest.mark.parametrize(
    "part", ["embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"]
)
def test_each_part_of_granite_counts(
    part: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """Granite's four multipliers: the per-step logits match transformers' with them (and its greedy tokens,
    test_more_architectures_...) and not with any one of them 1 (the attention's scale: head_dim's)."""
    ref = _reference("tiny-granite", load, hf_model)
    assert sum(len(set(tokens)) for tokens in ref.tokens) > 3 * len(ref.tokens)  # (not one token over and over)
    _check_per_step_logits(ref)
    model, arch = ref.loaded.model, ref.loaded.arch
    layers = list(model.layers)
    try:
        # (The embeddings, the logits and the engine's attention backend read the arch; the layers their own.)
        model.arch = dataclasses.replace(arch, **{part: None if part == "attention_multiplier" else 1.0})
        for layer in layers:
            layer.residual_multiplier = model.arch.residual_multiplier
        changed = copy.copy(ref)
        changed.loaded = dataclasses.replace(ref.loaded, arch=model.arch)
        with pytest.raises(AssertionError, match="largest logit difference"):
            _check_per_step_logits(changed)
    finally:
        model.arch = arch
        for layer in layers:
            layer.residual_multiplier = arch.residual_multiplier


@pytest.mark.parametrize("config", ["chunked-prefill", "preemption-swap", "speculative"])
def test_gpt_oss_matches_transformers_under_the_engines_configurations(
    config: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """gpt-oss in chunks of 7 tokens over cached prefixes, swapped out and back, and with drafts checked in one pass:
    transformers' greedy tokens (a chunk's partials and the sinks merged after every key of its context)."""
    ref = _reference("tiny-gpt-oss", load, hf_model)
    options = dict(CONFIGS[config])
    if options.pop("preempt", False):
        blocks, max_len = _pool_for_preemption(ref.prompts, 16)
        options.update(num_kv_blocks=blocks, max_model_len=max_len)
    assert _run_greedy(_engine(ref.loaded, **options), ref.prompts) == ref.tokens


@pytest.mark.parametrize("part", [None, "sinks", "o_bias", "swiglu_limit", "expert_biases"])
def test_each_part_of_gpt_oss_counts(
    part: str | None, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """gpt-oss's per-step logits are transformers' (its windows, YaRN, biases, sinks, clamped experts); without its
    sinks, o's bias, the experts' clamp, or their and the router's biases they are not."""
    ref = _reference("tiny-gpt-oss", load, hf_model)
    assert sum(len(set(tokens)) for tokens in ref.tokens) > 3 * len(ref.tokens)  # (not one token over and over)
    if part is None:
        _check_per_step_logits(ref)
        return
    layers = list(ref.loaded.model.layers)
    saved = [{n: p.detach().clone() for n, p in layer.named_parameters()} for layer in layers]
    limits = [layer.moe.swiglu_limit for layer in layers]
    try:
        with torch.no_grad():
            for layer in layers:
                if part == "swiglu_limit":
                    layer.moe.swiglu_limit = 1e9
                for name, param in layer.named_parameters():
                    expert_bias = name.startswith("moe.") and name.endswith("bias")
                    if {"sinks": name == "sinks", "o_bias": name == "o_bias"}.get(part, expert_bias):
                        param.fill_(float("-inf") if name == "sinks" else 0.0)
        ref.loaded.model._packed_key = None  # (packed again from the changed weights)
        with pytest.raises(AssertionError, match="largest logit difference"):
            _check_per_step_logits(ref)
    finally:
        with torch.no_grad():
            for layer, params, limit in zip(layers, saved, limits, strict=True):
                layer.moe.swiglu_limit = limit
                for name, param in layer.named_parameters():
                    param.copy_(params[name])
        ref.loaded.model._packed_key = None


# (The Triton kernels' case takes 14 s in the interpreter: slow on the CPU; the kernel's own MXFP4 tests are fast,
# tests/model/test_fused_moe.py.)
@pytest.mark.parametrize(
    "backend", ["native", "torch", pytest.param("triton", marks=pytest.mark.slow if _ON_CPU else ())]
)
def test_gpt_oss_experts_held_in_mxfp4_match_transformers(
    backend: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any], model_dirs: dict[str, Path]
) -> None:
    """gpt-oss's experts held as the checkpoint's MXFP4 blocks and scales (SparseMoE.hold_mxfp4: the default on
    CUDA), a quarter of bfloat16's bytes: transformers' per-step logits on the native path (each expert dequantized
    as it is packed), PyTorch's (an expert dequantized as a step chooses it) and the Triton kernels' (the fused experts
    dequantizing each tile in registers; Triton's interpreter on the CPU)."""
    ref = _reference("tiny-gpt-oss-mxfp4", load, hf_model)
    device = ref.loaded.device
    if backend == "triton" and not triton_paged.available(device):
        pytest.skip("triton unavailable")
    held = load_model(str(model_dirs["tiny-gpt-oss-mxfp4"]), device=device.type, quantized_experts=True)
    moe = held.model.layers[0].moe
    assert moe is not None and moe.gate_up is None and moe.gate_up_blocks.dtype == torch.uint8
    num_experts, hidden = moe.router.shape
    held_bytes = sum(p.numel() for p in moe.parameters() if p.dtype == torch.uint8)
    assert held_bytes * 64 == num_experts * 3 * hidden * moe.inter * 2 * 17  # (4.25 bits of bf16's 16)
    options = {"attention_backend": backend} if backend != "native" else {}
    _check_per_step_logits(_held(ref, held), **options)


def _held(ref: Reference, loaded: LoadedModel) -> Reference:
    """``ref``'s prompts, tokens and logits for another loading of its model."""
    other = copy.copy(ref)
    other.loaded = loaded
    return other


# (The correction in the fast set; the groups, the scale and the shared expert, ~3 s each here, in the slow one.)
@pytest.mark.parametrize(
    "part", [None, "score_bias", *(pytest.param(p, marks=pytest.mark.slow) for p in ("groups", "scaling", "shared"))]
)
def test_each_part_of_glm4_moes_routing_counts(
    part: str | None, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """GLM-4.5's per-step logits are transformers' (sigmoid scores, the choice's correction, groups, the weights'
    scale, the shared expert); without the correction, with one group, unscaled or without the shared expert they
    are not."""
    ref = _reference("tiny-glm4-moe", load, hf_model)
    assert sum(len(set(tokens)) for tokens in ref.tokens) > 3 * len(ref.tokens)  # (not one token over and over)
    if part is None:
        _check_per_step_logits(ref)
        return
    mixtures = [layer.moe for layer in ref.loaded.model.layers if layer.moe is not None]
    assert len(mixtures) == 2  # (the first layer dense)
    saved = [
        (m.score_bias.detach().clone(), m.groups, m.routed_scaling_factor, m.shared_down.detach().clone())
        for m in mixtures
    ]  # type: ignore[union-attr]
    try:
        with torch.no_grad():
            for m in mixtures:
                if part == "score_bias":
                    m.score_bias.zero_()  # type: ignore[union-attr]
                elif part == "groups":
                    m.groups = 1
                elif part == "scaling":
                    m.routed_scaling_factor = 1.0
                else:
                    m.shared_down.zero_()  # type: ignore[union-attr]
        ref.loaded.model._packed_key = None  # (packed again from the changed weights)
        with pytest.raises(AssertionError, match="largest logit difference"):
            _check_per_step_logits(ref)
    finally:
        with torch.no_grad():
            for m, (bias, groups, scaling, shared) in zip(mixtures, saved, strict=True):
                m.score_bias.copy_(bias)  # type: ignore[union-attr]
                m.groups, m.routed_scaling_factor = groups, scaling
                m.shared_down.copy_(shared)  # type: ignore[union-attr]
        ref.loaded.model._packed_key = None


def test_smollm3s_layer_without_rope_counts(load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]) -> None:
    """SmolLM3's middle layer rotates nothing: the per-step logits are transformers' (test_more_architectures_... its
    tokens), and with that layer rotated too they are not."""
    ref = _reference("tiny-smollm3", load, hf_model)
    assert ref.loaded.arch.nope_layers == (1,)
    _check_per_step_logits(ref)
    layer = ref.loaded.model.layers[1]
    try:
        layer.rope = True
        with pytest.raises(AssertionError, match="largest logit difference"):
            _check_per_step_logits(ref)
    finally:
        layer.rope = False


def test_heads_of_20_dimensions_as_many_for_keys_match_transformers(tmp_path: Path) -> None:
    """A head size that is no multiple of 8 with a key/value head for every query head: PyTorch's attention output is
    strided so that no view flattens it (the native path's view raised); transformers' greedy tokens."""
    path = write_random_model(tmp_path / "m", TinySpec(hidden_size=80, num_heads=4, num_kv_heads=4, seed=5))
    loaded = load_model(str(path))
    assert loaded.arch.head_dim == 20
    ref = Reference(loaded, load_hf_reference(loaded), TEXTS[:5])
    assert _run_greedy(_engine(loaded), ref.prompts) == ref.tokens


def test_glm4s_interleaved_rope_counts(
    load: Callable[[str], LoadedModel],
    hf_model: Callable[[str], Any],
    model_dirs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GLM-4's RoPE rotates adjacent pairs: its q and k rows reordered as they load, the per-step logits are
    transformers' (test_more_architectures_... its tokens); loaded as they are, rotating the halves, they are not."""
    from boundless.model.arch import ModelArch

    ref = _reference("tiny-glm4", load, hf_model)
    assert ref.loaded.arch.rope_interleaved and ref.loaded.arch.rotary_dim == ref.loaded.arch.head_dim // 2
    _check_per_step_logits(ref)
    monkeypatch.setattr(ModelArch, "rope_interleaved", property(lambda self: False))
    halves = copy.copy(ref)
    halves.loaded = load_model(str(model_dirs["tiny-glm4"]), device=ref.loaded.device.type)
    with pytest.raises(AssertionError, match="largest logit difference"):
        _check_per_step_logits(halves)


@pytest.mark.parametrize("names", ["transformers-5", "transformers-4"])
def test_a_gemma3_multimodal_checkpoint_serves_its_text_model(
    names: str,
    load: Callable[[str], LoadedModel],
    hf_model: Callable[[str], Any],
    model_dirs: dict[str, Path],
    tmp_path: Path,
) -> None:
    """Gemma 3's 4B, 12B and 27B are Gemma3ForConditionalGeneration checkpoints: a vision tower beside the language
    model, whose config is the text_config and whose tensors are named under the language model (transformers 5:
    ``model.language_model.``; the Hub's files, written by transformers 4: ``language_model.model.``). Such a checkpoint
    of the tiny Gemma 3's text weights and a random vision tower serves text as transformers' multimodal model does."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ref = _reference("tiny-gemma3", load, hf_model)
    source = model_dirs["tiny-gemma3"]
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}  # fmt: skip
    config = Gemma3Config(
        text_config=json.loads((source / "config.json").read_text()), vision_config=vision, mm_tokens_per_image=4
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    file = _save_multimodal(model, source, tmp_path / "multimodal")
    if names == "transformers-4":  # (the Hub's files: the language model's prefix first, the vision tower's alone)
        renamed = {
            k.replace("model.language_model.", "language_model.model.").removeprefix("model."): v
            for k, v in load_file(str(file)).items()
        }
        assert any(k.startswith("vision_tower.") for k in renamed)
        save_file(renamed, str(file), metadata={"format": "pt"})
    _check_served_as_text(model, file.parent, ref)


def _save_multimodal(model: Any, source: Path, path: Path) -> Path:
    """``model`` (a multimodal ``...ForConditionalGeneration``) with the text weights of the model directory
    ``source`` in its language model (and its head, where it has one of its own), saved at ``path`` with ``source``'s
    tokenizer; returns its safetensors file."""
    from safetensors.torch import load_file

    text = load_file(str(source / "model.safetensors"))
    language = {k.removeprefix("model."): v for k, v in text.items() if k != "lm_head.weight"}
    model.model.language_model.load_state_dict(language)
    if "lm_head.weight" in text:
        model.lm_head.load_state_dict({"weight": text["lm_head.weight"]})
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    (file,) = path.glob("*.safetensors")
    return file


def _check_served_as_text(model: Any, path: Path, ref: Reference) -> None:
    """The multimodal checkpoint at ``path`` loads as ``ref``'s text model (its head found), and transformers'
    multimodal ``model`` and the engine give ``ref``'s tokens, on text."""
    loaded = load_model(str(path))
    assert loaded.arch == ref.loaded.arch and loaded.generates
    assert Reference(loaded, model).tokens == ref.tokens
    assert _run_greedy(_engine(loaded), ref.prompts) == ref.tokens


@pytest.mark.parametrize("names", ["transformers-5", "transformers-4"])
def test_a_mistral3_multimodal_checkpoint_serves_its_text_model(
    names: str,
    load: Callable[[str], LoadedModel],
    hf_model: Callable[[str], Any],
    model_dirs: dict[str, Path],
    tmp_path: Path,
) -> None:
    """Mistral Small 3.1 and 3.2 (and Magistral Small from 1.1) are Mistral3ForConditionalGeneration checkpoints: a
    Pixtral vision tower beside a Mistral, whose config is the text_config and whose tensors, its untied LM head's
    among them, are named under the language model. Such a checkpoint of the tiny windowed Mistral's weights serves
    text as transformers' multimodal model does (the head found under either name: without it the model was taken
    for an embedding model)."""
    from safetensors.torch import load_file, save_file
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    ref = _reference("tiny-mistral-window", load, hf_model)
    source = model_dirs["tiny-mistral-window"]
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "head_dim": 16, "image_size": 28, "patch_size": 14}  # fmt: skip
    # (The text_config's untied head, as vLLM reads it; transformers 5 ties by the top level's flag, True by default.)
    config = Mistral3Config(
        text_config=json.loads((source / "config.json").read_text()), vision_config=vision, tie_word_embeddings=False
    )
    model = Mistral3ForConditionalGeneration(config).eval()
    file = _save_multimodal(model, source, tmp_path / "multimodal")
    saved = load_file(str(file))  # (as the Hub's files have them: transformers 5 saves a Mistral 3 so)
    assert "language_model.lm_head.weight" in saved and any(k.startswith("vision_tower.") for k in saved)
    if names == "transformers-5":  # (transformers 5's own names in memory, as a converter might save them)
        renamed = {
            k.replace("language_model.lm_head.", "lm_head.")
            .replace("language_model.model.", "language_model.")
            .replace("language_model.", "model.language_model.", 1)
            .replace("vision_tower.", "model.vision_tower.", 1)
            .replace("multi_modal_projector.", "model.multi_modal_projector.", 1): v
            for k, v in saved.items()
        }
        assert "lm_head.weight" in renamed and any(k.startswith("model.language_model.layers.") for k in renamed)
        save_file(renamed, str(file), metadata={"format": "pt"})
    _check_served_as_text(model, file.parent, ref)


def _gemma_sentencepiece(size: int) -> list[tuple[str, float, int]]:
    """A SentencePiece vocabulary of ``size`` pieces laid out as Gemma's GGUF files hold theirs: (piece, score, type)
    with its special tokens first (control, type 3; ``<unk>`` unknown, 2), the 256 byte pieces (6), then pieces whose
    ``▁`` is a space, best first."""
    special = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<start_of_turn>", 3), ("<end_of_turn>", 3)]
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "\u2581t", "\u2581th", "\u2581the", "he", "in", "\u2581a"]
    pieces += [f"\u2581{c}" for c in "bcdefghijklmnopqrsuvwxyz"]
    vocab = special + [(f"<0x{b:02X}>", 6) for b in range(256)] + [(piece, 1) for piece in pieces]
    vocab += [(f"<unused{i}>", 5) for i in range(size - len(vocab))]
    return [(piece, -float(i), kind) for i, (piece, kind) in enumerate(vocab[:size])]


def _gemma3_gguf(source: Path, path: Path, sentencepiece: bool = False) -> None:
    """A GGUF file of a Gemma 3 directory as llama.cpp's converter writes one: its tensors under llama.cpp's names, F32,
    each norm's weight plus one; what the file does not say (the local RoPE base, every 6th layer global, the softmax
    scale) as llama.cpp fixes it. Its byte-level BPE vocabulary is stored as such, or with ``sentencepiece`` one of
    Gemma's kind in its place (:func:`_gemma_sentencepiece`)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((source / "config.json").read_text())
    vocab = json.loads((source / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(path, arch="gemma3")
    add_shape(writer, config, head_dim=True)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_sliding_window(config["sliding_window"])
    if sentencepiece:
        pieces = _gemma_sentencepiece(config["vocab_size"])
        writer.add_tokenizer_model("llama")
        writer.add_token_list([piece for piece, _, _ in pieces])
        writer.add_token_scores([score for _, score, _ in pieces])
        writer.add_token_types([kind for _, _, kind in pieces])
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_add_space_prefix(False)
    else:
        add_bpe_vocabulary(writer, vocab)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            gguf_name = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.weight"
        array = tensor.float().numpy()
        writer.add_tensor(gguf_name, array + 1 if name.endswith("norm.weight") else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("sentencepiece", [False, True], ids=["byte-level", "sentencepiece"])
def test_a_gemma3_gguf_file_matches_transformers(
    sentencepiece: bool,
    load: Callable[[str], LoadedModel],
    hf_model: Callable[[str], Any],
    model_dirs: dict[str, Path],
    tmp_path: Path,
) -> None:
    """The tiny Gemma 3's weights written as llama.cpp writes a Gemma 3 GGUF, and beside them a config of what such a
    file means (llama.cpp's fixed values where the tiny model's differ: every 6th layer global, the local layers' RoPE
    base 10,000, the softmax scale the head size's, no RoPE scaling): transformers' greedy tokens from that
    directory, and ours from the file; with a SentencePiece vocabulary as Gemma's files have (its text to pieces as
    Gemma's tokenizer makes them, and back), a chat answered."""
    source = Path(shutil.copytree(model_dirs["tiny-gemma3"], tmp_path / "gemma3-every-6th"))
    config = json.loads((source / "config.json").read_text())
    config.update(
        sliding_window_pattern=6,
        rope_local_base_freq=10000.0,
        rope_scaling=None,
        query_pre_attn_scalar=config["head_dim"],
    )
    (source / "config.json").write_text(json.dumps(config))
    path = tmp_path / "gemma3.gguf"
    _gemma3_gguf(source, path, sentencepiece)
    from_dir, from_file = load_model(str(source)), load_model(str(path))
    assert from_file.arch.full_attention_layers == from_dir.arch.full_attention_layers == ()
    assert dataclasses.replace(from_file.arch, eos_token_ids=(), bos_token_id=None) == dataclasses.replace(
        from_dir.arch, eos_token_ids=(), bos_token_id=None
    )
    ref = Reference(from_dir, load_hf_reference(from_dir))
    # (The file's end token is llama.cpp's Gemma one, not the directory's that transformers holds back: none is.)
    unheld = dataclasses.replace(GREEDY, ignore_eos=True)
    assert _run_greedy(_engine(from_file), ref.prompts, params=unheld) == ref.tokens
    if sentencepiece:
        tokenizer = from_file.tokenizer
        ids = tokenizer.encode("the cat", add_special_tokens=False)
        # (Gemma's prefixes no space: "the" at the start is not the piece "\u2581the".)
        assert tokenizer.convert_ids_to_tokens(ids) == ["t", "he", "\u2581c", "a", "t"]
        assert tokenizer.decode(ids) == "the cat"
        assert tokenizer.encode("x")[0] == tokenizer.bos_token_id == 2 and 1 in tokenizer.eos_token_ids
        llm = LLM.from_config(engine_config(str(path), max_model_len=256), from_file)
        (out,) = llm.generate(["the end"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert out.prompt_token_ids[0] == 2 and len(out.outputs[0].token_ids) == 4


def test_yarn_per_step_logits_match_transformers(
    load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """YaRN's frequencies and its scale of cos and sin, position by position (prompts past the original context)."""
    ref = _reference("tiny-qwen3-yarn", load, hf_model)
    assert max(len(p) for p in ref.prompts) > 32
    _check_per_step_logits(ref)


def _check_per_step_logits(ref: Reference, **options: Any) -> None:
    core = _engine(ref.loaded, **{"max_num_batched_tokens": 64, **options})
    worst = 0.0
    for i, ours in enumerate(step_logits(core, ref.prompts, GREEDY)):
        assert ours.shape == ref.logits[i].shape
        worst = max(worst, (ours - ref.logits[i]).abs().max().item())
    assert worst < 1e-3, f"largest logit difference {worst}"


class _OpenAIPenalties:
    """The reference's presence and frequency penalties, OpenAI's formula written out: each token the output holds
    loses ``frequency`` per occurrence and ``presence`` once (transformers has no such processor)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for token, times in Counter(input_ids[0, self.prompt_len :].tolist()).items():
            scores[0, token] -= self.frequency * times + self.presence
        return scores


PENALTY_CASES = {
    "repetition": {"repetition_penalty": 1.3},
    "frequency-presence": {"frequency_penalty": 0.7, "presence_penalty": 0.4},
    # With multi-step windows, whose passes' tokens reach the request only when the window ends.
    "all-windowed": {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": -0.2, "windows": 4},
}


# SmolLM2 takes ~7 s a case here: its cases are in the slow suite, the tiny models' in the fast one.
PENALTY_PARAMS = [
    pytest.param(name, case, marks=pytest.mark.slow if name == "smollm2-135m" else ())
    for name in MODELS
    for case in PENALTY_CASES
]


@pytest.mark.parametrize(("name", "case"), PENALTY_PARAMS)
def test_penalties_and_logit_bias_match_transformers(
    name: str, case: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """Greedy with penalties and a logit bias, batched, against transformers' generate with its repetition penalty,
    its single-token sequence bias (the same order: bias, repetition, then the rest) and OpenAI's penalties."""
    from transformers import LogitsProcessorList

    options = dict(PENALTY_CASES[case])
    windows = int(options.pop("windows", 1))
    ref, model = _reference(name, load, hf_model), hf_model(name)
    prompts = ref.prompts[:5]  # (transformers' generate, a prompt at a time, is most of the time)
    # Each prompt's unpenalized first token forbidden, and one token favoured.
    biases = [((tokens[0], -100.0), (17, 1.5)) for tokens in ref.tokens[:5]]
    expected = []
    with torch.inference_mode():
        for p, bias in zip(prompts, biases, strict=True):
            out = model.generate(
                torch.tensor([p], device=ref.loaded.device),
                attention_mask=torch.ones(1, len(p), dtype=torch.long, device=ref.loaded.device),
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                pad_token_id=0,
                repetition_penalty=options.get("repetition_penalty", 1.0),
                sequence_bias={(t,): b for t, b in bias},
                logits_processor=LogitsProcessorList(
                    [
                        _OpenAIPenalties(
                            len(p), options.get("presence_penalty", 0.0), options.get("frequency_penalty", 0.0)
                        )
                    ]
                ),
            )
            expected.append(out[0, len(p) :].tolist())
    core = _engine(ref.loaded, num_scheduler_steps=windows)
    for i, (p, bias) in enumerate(zip(prompts, biases, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logit_bias=bias, **options)
        core.add_request(str(i), p, params)
    core.add_request("plain", ref.prompts[1], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while core.has_unfinished():
        for delta in core.step():
            got.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    for i, theirs in enumerate(expected):
        assert got[str(i)] == theirs, f"prompt {i} ({len(prompts[i])} tokens) diverges"
    assert got["plain"] == ref.tokens[1]  # a request without them in the same batch is untouched
    # The penalties changed something beyond the bias's first token (or this test would not see them).
    assert sum(ours[1:] != plain[1:] for ours, plain in zip(expected, ref.tokens[:5], strict=True)) >= 2


# SmolLM2's (4 and 9 s here) in the slow suite, the tiny models' in the fast one.
@pytest.mark.parametrize("ref", [pytest.param("smollm2-135m", marks=pytest.mark.slow), *MODELS[1:]], indirect=True)
@pytest.mark.parametrize("tier", [HOST, DISK])
def test_prefixes_from_host_memory_and_from_disk_match_transformers(
    ref: Reference, tier: str, dict_store: type, tmp_path
) -> None:
    """The prompts run twice through a device pool that holds only a few of them, all at once (with
    preemptions). The second time their prefixes come back from host memory, or (with host memory of 8 blocks)
    from the disk store, which write-through filled in the first round. With the disk, a third round runs
    each prompt alone with nothing left in memory: every prefix comes from the store. A request whose prefix
    came from a lower tier produces the tokens of a cold one. The store is conftest's DictStore until the
    persistent one lands."""
    loaded = ref.loaded
    blocks, max_len = _pool_for_preemption(ref.prompts, 16)
    arch = loaded.arch
    per_block = PagedKVCache.bytes_per_block(arch.num_layers, arch.num_kv_heads, arch.head_dim, 16, loaded.dtype)
    host_blocks = 256 if tier == HOST else 8
    disk = {"kv_disk_path": str(tmp_path), "kv_write_policy": "through"} if tier == DISK else {}
    cfg = EngineConfig(
        model=ModelConfig(max_model_len=max_len),
        cache=CacheConfig(num_kv_blocks=blocks, kv_host_gb=host_blocks * per_block / (1 << 30) * 1.001, **disk),
    )
    layout = size_engine(cfg, arch, loaded.dtype)
    assert layout.num_host_blocks == host_blocks
    store = dict_store() if tier == DISK else None
    executor = build_model_executor(loaded, cfg, layout, store=store)
    core = EngineCore(cfg, layout, ModelIdentity.of(loaded, layout), loaded.tokenizer, executor)
    first = _run_greedy(core, ref.prompts, "first-")
    executor.kv_io.flush()  # the first round's blocks are in the store
    cached_before = dict(core.scheduler.stats.cached_tokens_by_tier)
    second = _run_greedy(core, ref.prompts, "second-")
    for i, (a, b, theirs) in enumerate(zip(first, second, ref.tokens, strict=True)):
        assert a == theirs and b == theirs, f"prompt {i} ({len(ref.prompts[i])} tokens) diverges"
    if tier == HOST:
        from_host = core.scheduler.stats.cached_tokens_by_tier.get(HOST, 0) - cached_before.get(HOST, 0)
        assert from_host > 0, "no prefix came from host memory"
        return
    # Under preemption, loads from the store may serve recomputes rather than first admissions (which alone
    # the per-tier counts attribute): the third round checks the store by itself.
    assert store.reads > 0 and core.stats().kv_tiers[DISK].bytes_read > 0
    executor.kv_io.flush()
    for i, prompt in enumerate(ref.prompts):
        core.reset_prefix_cache()
        before = core.scheduler.stats.cached_tokens_by_tier.get(DISK, 0)
        (alone,) = _run_greedy(core, [prompt], f"alone-{i}-")
        assert alone == ref.tokens[i], f"prompt {i} ({len(prompt)} tokens) diverges with its prefix from disk"
        from_disk = core.scheduler.stats.cached_tokens_by_tier.get(DISK, 0) - before
        # All its full blocks but the last token's, up to the half of host memory prefetches may take.
        expected = min((len(prompt) - 1) // 16, host_blocks // 2) * 16
        assert from_disk == expected, f"prompt {i}: {from_disk} tokens from disk, not {expected}"


LOGPROB_TOL = 1e-3  # as the per-step logits
PROMPT_TOP_K = 3


def _hf_prompt_logprobs(model: Any, prompt: list[int], device: torch.device) -> torch.Tensor:
    """transformers' log-softmax at each prompt position but the last: row ``i`` scores token ``i + 1``."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt], device=device)).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].cpu()


def _assert_prompt_logprobs_match(
    scored: list[PositionLogprobs | None] | None, prompt: list[int], theirs: torch.Tensor, k: int
) -> None:
    """Every prompt token scored (the first: None), in vLLM's shape (the token first, then its top ``k``
    alternatives), its logprob, rank and top ``k`` those of ``theirs``."""
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    worst = 0.0
    for i in range(1, len(prompt)):
        position, row = scored[i], theirs[i - 1]
        assert position is not None and next(iter(position)) == prompt[i]
        token = position[prompt[i]]
        worst = max(worst, abs(token.logprob - row[prompt[i]].item()))
        # Its rank, give or take the tokens within the tolerance of it (a random model has near ties).
        assert token.rank is not None
        assert int((row > token.logprob + LOGPROB_TOL).sum()) + 1 <= token.rank
        assert token.rank <= int((row > token.logprob - LOGPROB_TOL).sum()) + 1
        assert len(position) in ((k, k + 1) if k else (1,))  # (the token is one of its top k, or besides them)
        top = torch.tensor(sorted((e.logprob for e in position.values()), reverse=True)[:k])
        worst = max(worst, (top - row.topk(k).values).abs().max().item() if k else 0.0)
        worst = max(worst, max(abs(e.logprob - row[tid].item()) for tid, e in position.items()))
    assert worst < LOGPROB_TOL, f"largest logprob difference {worst}"


# SmolLM2's cases are in the slow suite, the tiny models' in the fast one (a second or two each).
PROMPT_LOGPROB_PARAMS = [
    pytest.param(name, case, marks=pytest.mark.slow if name == "smollm2-135m" else ())
    for name in MODELS
    for case in ("cached-prefix", "recompute")
]


@pytest.mark.parametrize(("name", "case"), PROMPT_LOGPROB_PARAMS)
def test_prompt_logprobs_match_transformers(
    name: str, case: str, load: Callable[[str], LoadedModel], hf_model: Callable[[str], Any]
) -> None:
    """Each prompt token's logprob, rank and top alternatives are transformers' log-softmax of its logits on the same
    weights. The prompts are prefilled in chunks of at most 16 tokens a step (a chunk's last position scores the next
    chunk's first token), in one batch with requests that ask for none, and decoded in windows of 4 passes. In
    ``cached-prefix`` the prefix cache holds the long prompt's blocks, which the scoring request must not take (it
    needs every position's logits) while a plain one does; in ``recompute`` a pool too small for the batch drops
    requests' KV to be recomputed (a scored token is not scored again)."""
    ref, model = _reference(name, load, hf_model), hf_model(name)
    loaded = ref.loaded
    long_prompt = ref.prompts[7]
    options: dict[str, Any] = {"max_num_batched_tokens": 16, "num_scheduler_steps": 4, "max_model_len": 512}
    if case == "recompute":
        blocks, max_len = _pool_for_preemption(ref.prompts, 16)
        options.update(num_kv_blocks=blocks, max_model_len=max_len, swap_space_gb=0.0)
    llm = LLM.from_config(engine_config(loaded.name, **options), loaded)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    scored = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=PROMPT_TOP_K, logprobs=PROMPT_TOP_K
    )
    if case == "cached-prefix":
        llm.generate([long_prompt], greedy)  # its full blocks stay in the prefix cache
        picks = [3, 7, 4, 1]
        params = [greedy, scored, greedy, dataclasses.replace(scored, prompt_logprobs=0)]
    else:
        picks = list(range(len(ref.prompts)))
        params = [scored if i % 2 == 0 else greedy for i in picks]
    outs = llm.generate([ref.prompts[i] for i in picks], params)
    for i, p, out in zip(picks, params, outs, strict=True):
        assert out.outputs[0].token_ids == ref.tokens[i], f"prompt {i} diverges"
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        theirs = _hf_prompt_logprobs(model, ref.prompts[i], loaded.device)
        _assert_prompt_logprobs_match(out.prompt_logprobs, ref.prompts[i], theirs, p.prompt_logprobs)
        assert out.outputs[0].logprobs is not None and len(out.outputs[0].logprobs) == MAX_NEW
    stats = llm.engine.scheduler.stats
    if case == "recompute":
        assert stats.num_recomputed > 0
        return
    assert outs[1].num_cached_tokens == 0  # the scoring request computed its whole prompt
    again = llm.generate([long_prompt], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert again.num_cached_tokens >= len(long_prompt) // 16 * 16 - 16  # the cache held it all along
