"""``--kv-cache-dtype``: a KV cache in 8 (or 16) bits through the whole engine: the pool's size, a real model's
answers, prefill chunked or not and prefix hits, blocks swapped to host memory and written to the disk store and
read back, and the flags that do not go with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from boundless.attention import cpu_attention
from boundless.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.builder import ModelIdentity, build_model_executor, size_engine
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.kv.cache_dtype import index_copy, kv_cache_dtype, to_cache
from boundless.kv.transfer import DISK
from boundless.model.loader import LoadedModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _engine(loaded: LoadedModel, kv_dtype: str, max_model_len: int = 512, **cache: object) -> EngineCore:
    scheduler = {k: cache.pop(k) for k in ("max_num_batched_tokens", "max_num_seqs") if k in cache}
    config = EngineConfig(
        model=ModelConfig(max_model_len=max_model_len),
        cache=CacheConfig(kv_cache_dtype=kv_dtype, **{"num_kv_blocks": 64, "kv_host_gb": 0, **cache}),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(policy="fcfs", **scheduler),  # type: ignore[arg-type]
    )
    layout = size_engine(config, loaded.arch, loaded.dtype)
    executor = build_model_executor(loaded, config, layout)
    return EngineCore(config, layout, ModelIdentity.of(loaded, layout), loaded.tokenizer, executor)


def _run(core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[str, list]:
    """Each request's sampled tokens (``SampledToken``, with logprobs where asked)."""
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, params)
    out: dict[str, list] = {rid: [] for rid in prompts}
    while core.has_unfinished():
        for delta in core.step():
            out[delta.request_id] += delta.new_logprobs or delta.new_token_ids
    return out


def test_the_names_give_the_types_and_an_unknown_one_is_refused_naming_the_flag() -> None:
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ConfigError, match="--kv-cache-dtype: unknown KV cache dtype 'int4'"):
        CacheConfig(kv_cache_dtype="int4")


def test_an_8_bit_cache_holds_four_times_an_fp32_models_tokens_in_the_same_memory(tiny_llama: LoadedModel) -> None:
    def layout(kv_dtype: str):
        config = EngineConfig(cache=CacheConfig(kv_cache_gb=1 / 64, kv_cache_dtype=kv_dtype, kv_host_gb=1 / 32))
        return size_engine(config, tiny_llama.arch, tiny_llama.dtype)

    full, half, fp8 = layout("auto"), layout("bfloat16"), layout("fp8")
    assert (half.kv_dtype, fp8.kv_dtype) == (torch.bfloat16, torch.float8_e4m3fn)
    assert fp8.bytes_per_block * 4 == half.bytes_per_block * 2 == full.bytes_per_block
    assert fp8.num_blocks == 4 * full.num_blocks and half.num_blocks == 2 * full.num_blocks
    assert fp8.num_host_blocks == 4 * full.num_host_blocks
    core = _engine(tiny_llama, "fp8")
    assert core.executor.runner.kv_cache.data.dtype == torch.float8_e4m3fn


def test_index_copy_moves_8_bit_blocks_as_their_bytes() -> None:
    """PyTorch's CPU ``index_copy_`` has no 8-bit kernel; the pool's block writes (swaps, loads, moves) use it."""
    dst = torch.zeros(2, 5, 3, dtype=torch.float8_e5m2)
    src = torch.randn(2, 2, 3)
    index_copy(dst, 1, torch.tensor([4, 1]), src)
    assert torch.equal(dst[:, [4, 1]].view(torch.uint8), to_cache(src, torch.float8_e5m2).view(torch.uint8))
    assert not dst[:, [0, 2, 3]].float().any()


def test_smollm2_with_an_fp8_cache_answers_as_with_its_own(smollm2: LoadedModel) -> None:
    """The bundled model, its KV rounded to e4m3, reads 300 tokens of this project's README: each token's
    log-probability moves by under 0.15 nats on average (0.08 here) and the text's mean negative log-likelihood by
    under 1% (``bench kv-dtype`` measures it on other text: docs/engine.md). Its greedy answers start as the fp32
    cache's do."""
    tok = smollm2.tokenizer
    text = tok.encode((Path(__file__).parents[2] / "README.md").read_text()[2000:6000])[:300]
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    nll, shift = {}, []
    for kv_dtype in ("auto", "fp8"):
        core = _engine(smollm2, kv_dtype)
        core.add_request("r", text, scored)
        while core.has_unfinished():
            for delta in core.step():
                if delta.prompt_logprobs is not None:
                    nll[kv_dtype] = [-s.logprob for s in delta.prompt_logprobs[1:] if s is not None]
    shift = [abs(a - b) for a, b in zip(nll["auto"], nll["fp8"], strict=True)]
    assert len(shift) == 299 and sum(shift) / len(shift) < 0.15
    assert abs(sum(nll["fp8"]) / sum(nll["auto"]) - 1) < 0.01
    prompt = {"p": tok.encode("def fibonacci(n):\n")}
    assert _run(_engine(smollm2, "fp8"), prompt)["p"][:10] == _run(_engine(smollm2, "auto"), prompt)["p"][:10]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_an_8_bit_prompt_gives_the_same_tokens_chunked_whole_or_from_the_prefix_cache(
    tiny_llama: LoadedModel, kv_dtype: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk reads its own new keys rounded as the cache holds them, so chunking a prompt, or finding its prefix
    cached, reads the same keys: the same answer each way. (The PyTorch path takes a chunk's own keys from the step's
    rows, and took them unrounded: a chunked prompt's answer differed from the whole one's.)"""
    if not native:
        monkeypatch.setattr(cpu_attention, "supports", lambda *a: False)
    prompt = [(7 * j) % 300 + 3 for j in range(90)]
    whole = _run(_engine(tiny_llama, kv_dtype), {"r": prompt})["r"]
    chunked = _run(_engine(tiny_llama, kv_dtype, max_num_batched_tokens=16), {"r": prompt})["r"]
    assert chunked == whole
    core = _engine(tiny_llama, kv_dtype)
    first = _run(core, {"a": prompt[:64]})  # 4 full blocks cached
    assert _run(core, {"b": prompt})["b"] == whole and first["a"]
    assert core.stats().prefix_cache_hits >= 64


def test_requests_swapped_to_host_memory_in_fp8_resume_with_their_kv(tiny_llama: LoadedModel) -> None:
    """A pool too small for the batch swaps requests' 8-bit blocks to host memory and back (``index_copy`` of 8-bit
    blocks): each answer is the one it gets alone."""
    prompts = {f"r{i}": [(11 * j + 5 * i) % 300 + 3 for j in range(40)] for i in range(4)}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = {rid: _run(_engine(tiny_llama, "fp8"), {rid: p}, params)[rid] for rid, p in prompts.items()}
    core = _engine(tiny_llama, "fp8", max_model_len=128, num_kv_blocks=12, kv_host_gb=0.01)
    assert _run(core, prompts, params) == alone
    assert core.stats().num_swapped_out > 0


def test_an_fp8_disk_store_is_read_back_by_an_fp8_engine_and_by_no_other(
    tiny_llama: LoadedModel, tmp_path: Path
) -> None:
    """Blocks written by an fp8 engine are its own type's: a restarted fp8 engine loads them (the same answer, with
    disk hits), and an engine with the model's own type finds none of them (the store's layout names the type)."""
    prompt = [(13 * j) % 300 + 3 for j in range(70)]
    store = {"kv_disk_path": str(tmp_path), "kv_host_gb": 0.01, "kv_write_policy": "through"}
    before = _engine(tiny_llama, "fp8", **store)
    cold = _run(before, {"a": prompt})["a"]
    before.close()
    after = _engine(tiny_llama, "fp8", **store)
    assert _run(after, {"b": prompt})["b"] == cold
    assert after.stats().kv_tiers[DISK].hit_tokens >= 64
    after.close()
    other = _engine(tiny_llama, "auto", **store)
    _run(other, {"c": prompt})
    assert other.stats().kv_tiers[DISK].hit_tokens == 0
    other.close()


def test_the_flex_backend_refuses_a_cache_in_another_type(tiny_llama: LoadedModel) -> None:
    config = EngineConfig(
        model=ModelConfig(attention_backend="flex", max_model_len=256),
        cache=CacheConfig(num_kv_blocks=16, kv_cache_dtype="fp8", kv_host_gb=0),
        scheduler=SchedulerConfig(max_num_batched_tokens=256),
    )
    layout = size_engine(config, tiny_llama.arch, tiny_llama.dtype)
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8: the flex backend"):
        build_model_executor(tiny_llama, config, layout)
