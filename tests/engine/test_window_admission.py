"""A model whose every layer slides, on a pool barely larger than a window and a step: admissions under the disk
store's loads, whose held prefixes must not keep a request out for ever, give the tokens of an engine with room for
everything."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.kv.tensors import PagedKVCache
from boundless.model.loader import LoadedModel

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _engine(loaded: LoadedModel, blocks: int, store: Path | None = None) -> EngineCore:
    arch = loaded.arch
    per_block = PagedKVCache.bytes_per_block(arch.num_layers, arch.num_kv_heads, arch.head_dim, 8, loaded.dtype)
    cache = CacheConfig(num_kv_blocks=blocks, block_size=8, kv_host_gb=6 * per_block / 2**30)
    if store is not None:
        cache = CacheConfig(**{**cache.__dict__, "kv_disk_path": str(store), "kv_disk_gb": 1.0})
    config = EngineConfig(model=ModelConfig(), cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=16))
    return EngineCore.from_model(loaded, config)


def _answer(core: EngineCore, rid: str, prompt: list[int], most_steps: int = 3000) -> list[int]:
    core.add_request(rid, prompt, PARAMS)
    out: list[int] = []
    for _ in range(most_steps):
        if not core.has_unfinished():
            return out
        for delta in core.step():
            out += delta.new_token_ids
        time.sleep(0.001)  # (the store's threads load meanwhile)
    raise AssertionError(f"{rid} unfinished after {most_steps} steps: {core.scheduler.requests[rid].status}")


def test_a_prefix_loading_from_the_store_does_not_hold_its_own_request_out(
    load: Callable[[str], LoadedModel], tmp_path: Path
) -> None:
    """A long conversation written to the store, a short call that brings its first blocks back to the device, then
    the conversation again, longer: its prefix's first blocks, held for it while the store loads the rest, are the
    ones its window skips; held, they kept it short of room for ever (nothing else ran to let them go)."""
    loaded = load("tiny-mistral-window")
    rng = random.Random(1)
    talk = [rng.randrange(3, 380) for _ in range(120)]
    core = _engine(loaded, 6, tmp_path / "store")
    _answer(core, "a", talk)
    _answer(core, "b", talk[:24] + [7])
    again = talk + [5] * 40
    assert _answer(core, "c", again) == _answer(_engine(loaded, 400), "c", again)
    core.close()
