"""Layerwise loads (``kv/layer_gate.py``): a request whose stored prefix is still crossing the storage link is
scheduled, its forward pass waits at each layer for that layer only, and its greedy tokens are those of a cold
run; a link that stalls mid-load is waited past after the load timeout, never hung on; a load that comes back
short computes the rest."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from boundless.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.builder import ModelIdentity, build_model_executor, size_engine
from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import SchedulerOutput
from boundless.kv.block_hash import extend_block_hashes
from boundless.kv.tensors import PagedKVCache
from boundless.kv.transfer import DISK, HOST
from boundless.model.loader import LoadedModel

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [(13 * j) % 300 + 3 for j in range(70)]  # four full blocks of 16, and six tokens


def _engine(loaded: LoadedModel, store, link, tmp_path: Path, **cache) -> EngineCore:
    cache.setdefault("layerwise_load", "on")
    arch = loaded.arch
    per_block = PagedKVCache.bytes_per_block(arch.num_layers, arch.num_kv_heads, arch.head_dim, 16, loaded.dtype)
    config = EngineConfig(
        model=ModelConfig(max_model_len=256),
        cache=CacheConfig(
            num_kv_blocks=32,
            kv_host_gb=64.5 * per_block / (1 << 30),
            kv_disk_path=str(tmp_path),
            kv_write_policy="through",
            **cache,
        ),
        scheduler=SchedulerConfig(policy="fcfs"),
    )
    layout = size_engine(config, loaded.arch, loaded.dtype)
    executor = build_model_executor(loaded, config, layout, store=store, read_link=link)
    return EngineCore(config, layout, ModelIdentity.of(loaded, layout), loaded.tokenizer, executor)


def _run(core: EngineCore, request_id: str, outputs: dict[str, list[int]]) -> list[int]:
    while request_id in core.scheduler.requests:
        for delta in core.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return outputs[request_id]


def _cold_then_stored(core: EngineCore, outputs: dict[str, list[int]]) -> list[int]:
    """The prompt run cold (its full blocks written through to the store), then gone from memory."""
    core.add_request("cold", PROMPT, PARAMS)
    cold = _run(core, "cold", outputs)
    core.executor.kv_io.flush()
    core.reset_prefix_cache()
    return cold


def _schedule_until_running(core: EngineCore, request_id: str) -> SchedulerOutput:
    """Step the engine until a step schedules the request (its load reported); that step, not run."""
    for _ in range(1000):
        sched = core.schedule()
        if any(c.request_id == request_id for c in sched.chunks):
            return sched
        core.finish_step(sched, core.execute(sched))
    raise AssertionError(f"{request_id} was never scheduled")


def _gates_of(core: EngineCore, sched: SchedulerOutput) -> list:
    return core.executor.kv_io.gates_for([t.src.block_id for t in sched.transfers if t.src.tier == HOST])


def test_a_request_runs_while_its_load_crosses_the_link_and_gives_the_cold_tokens(
    tiny_llama: LoadedModel, dict_store: type, held_link: type, tmp_path: Path
) -> None:
    link = held_link()
    core = _engine(tiny_llama, dict_store(), link, tmp_path)
    outputs: dict[str, list[int]] = {}
    cold = _cold_then_stored(core, outputs)
    core.add_request("again", PROMPT, PARAMS)
    sched = _schedule_until_running(core, "again")
    # Scheduled with its four stored blocks copied in from host memory, though no layer has crossed the link yet.
    assert sched.chunks[0].start_pos == 64
    gates = _gates_of(core, sched)
    assert len(gates) == 1 and gates[0].opened == 0 and link.parts_carried == 0
    result: list = []
    step = threading.Thread(target=lambda: result.append(core.execute(sched)))
    step.start()
    link.let_through(1)  # layer 0 only: the forward pass computes it and waits at layer 1
    step.join(timeout=0.3)
    assert step.is_alive() and not result
    link.let_through(tiny_llama.arch.num_layers)
    step.join(timeout=60)
    for delta in core.finish_step(sched, result[0]):
        outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert _run(core, "again", outputs) == cold
    stats = core.stats()
    assert stats.kv_tiers[DISK].hit_tokens >= 64
    assert stats.disk_io is not None and stats.disk_io.layerwise_loads == 1
    assert stats.disk_io.layer_wait_s > 0 and stats.disk_io.layer_wait_timeouts == 0


def test_with_layerwise_loads_off_a_request_waits_for_its_whole_load(
    tiny_llama: LoadedModel, dict_store: type, held_link: type, tmp_path: Path
) -> None:
    link = held_link()
    core = _engine(tiny_llama, dict_store(), link, tmp_path, layerwise_load="off")
    outputs: dict[str, list[int]] = {}
    cold = _cold_then_stored(core, outputs)
    core.add_request("again", PROMPT, PARAMS)
    sched = _schedule_until_running(core, "again")
    assert sched.chunks[0].start_pos == 64 and _gates_of(core, sched) == []
    for delta in core.finish_step(sched, core.execute(sched)):
        outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert _run(core, "again", outputs) == cold
    assert link.parts_carried == 0  # carried whole (the plain ``transfer``), never in parts
    stats = core.stats()
    assert stats.disk_io is not None and stats.disk_io.layerwise_loads == 0


def test_a_link_that_stalls_mid_load_is_waited_past_after_the_timeout(
    tiny_llama: LoadedModel, dict_store: type, held_link: type, tmp_path: Path
) -> None:
    link = held_link()
    core = _engine(tiny_llama, dict_store(), link, tmp_path, kv_load_timeout_s=0.2)
    outputs: dict[str, list[int]] = {}
    cold = _cold_then_stored(core, outputs)
    core.add_request("again", PROMPT, PARAMS)
    link.let_through(1)  # layer 0 crosses, then the link stalls for good
    try:
        assert _run(core, "again", outputs) == cold  # the bytes were in host memory: the same tokens, no hang
        stats = core.stats()
        assert stats.disk_io is not None and stats.disk_io.layer_wait_timeouts == 1
        assert stats.kv_tiers[DISK].hit_tokens >= 64
        assert core.scheduler.requests == {} and core.kv.num_reads_in_flight == 0
    finally:
        link.let_through(10_000)  # the loader goes on


@pytest.mark.parametrize("lost", [0, 2])
def test_a_load_that_comes_back_short_computes_the_rest(
    tiny_llama: LoadedModel, dict_store: type, held_link: type, tmp_path: Path, lost: int
) -> None:
    base = dict_store()
    link = held_link()
    link.let_through(10_000)
    core = _engine(tiny_llama, base, link, tmp_path)
    outputs: dict[str, list[int]] = {}
    cold = _cold_then_stored(core, outputs)
    keys = extend_block_hashes([], PROMPT[:64], 16, core.kv.fingerprint)
    del base.blocks[keys[lost]]  # unreadable from there on: the blocks after it are computed
    core.add_request("again", PROMPT, PARAMS)
    assert _run(core, "again", outputs) == cold
    stats = core.stats()
    assert stats.kv_tiers[DISK].hit_tokens == 16 * lost
    assert stats.disk_io is not None and stats.disk_io.layerwise_loads == (1 if lost else 0)


def test_an_unknown_layerwise_load_value_is_a_start_up_error() -> None:
    with pytest.raises(ConfigError, match="--layerwise-load"):
        CacheConfig(layerwise_load="sometimes")
