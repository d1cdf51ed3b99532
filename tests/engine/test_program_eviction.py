"""The engine with program-aware eviction: under memory pressure the prefix of a program that will be back soon
survives and that of a finished program goes, where LRU would do the opposite."""

from __future__ import annotations

import pytest

from boundless.engine.core import EngineCore
from boundless.engine.sampling_params import SamplingParams
from boundless.llm import engine_config
from boundless.model.loader import LoadedModel
from boundless.programs.ref import ProgramRef

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(engine: EngineCore, rid: str, prompt: list[int], program: str) -> None:
    engine.add_request(rid, prompt, ONE_TOKEN, program=ProgramRef(program))
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("eviction", ["lru", "program"])
def test_a_hot_programs_prefix_outlives_a_finished_programs(tiny_llama: LoadedModel, eviction: str) -> None:
    clock = Clock()
    # 16 blocks of 4 tokens on the device and nothing below it: an evicted block is gone.
    config = engine_config(
        tiny_llama.name, block_size=4, num_kv_blocks=16, kv_host_gb=0.0, max_model_len=64, policy="fcfs",
        program_ttl_s=5.0, kv_eviction=eviction,
    )  # fmt: skip
    engine = EngineCore.from_model(tiny_llama, config, clock=clock)
    hot, old = list(range(100, 116)), list(range(200, 216))  # four full blocks each
    _run(engine, "hot-1", hot, "hot")  # the hot program's first call ...
    clock.now = 1.0
    _run(engine, "old-1", old, "old")  # ... then the only call of a program that is done (more recent, though)
    clock.now = 10.0  # the old program has idled past its TTL
    # A new program's long call arrives just before the hot program's next one, and needs 12 blocks: the 8 never
    # named, and 4 cached ones.
    engine.add_request("big", list(range(300, 347)), ONE_TOKEN, program=ProgramRef("big"))
    hot_2 = engine.add_request("hot-2", [*hot, 1, 2, 3], ONE_TOKEN, program=ProgramRef("hot"))
    while engine.has_unfinished():
        engine.step()
    old_left = engine.kv.find_cached_prefix("probe", [*old, 0]).num_tokens
    if eviction == "program":
        assert hot_2.num_cached_tokens == 16 and old_left == 0
    else:  # LRU evicts the least recently used: the hot program's prefix
        assert hot_2.num_cached_tokens == 0
