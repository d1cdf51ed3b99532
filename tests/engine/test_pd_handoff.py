"""Prefill/decode disaggregation between two engines in this process, over a real shared-memory transport: a
prefill engine (PE) prefills and samples the first token while streaming the KV layer by layer to a decode
engine (DE), which decodes from the received blocks. Greedy outputs equal one engine's; streams that fail
free their blocks on both sides and the tokens are recomputed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.builder import ModelIdentity, build_model_executor, size_engine
from boundless.engine.core import EngineCore, RequestDelta, Resume
from boundless.engine.handoff import HandoffPlan, IntakePlan
from boundless.engine.sampling_params import SamplingParams
from boundless.kv.transfer import HOST, PEER
from boundless.model.loader import LoadedModel
from boundless.transport.shm import ShmTransport

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16
PROMPT = [(17 * j) % 300 + 3 for j in range(75)]  # 4 full blocks and 11 tokens


def _core(loaded: LoadedModel, store: object | None = None, tmp: Path | None = None) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(max_model_len=512),
        cache=CacheConfig(
            num_kv_blocks=48,
            kv_host_gb=0.004,
            kv_disk_path=str(tmp) if store is not None else None,
            kv_write_policy="through",
        ),
        scheduler=SchedulerConfig(policy="fcfs"),
    )
    layout = size_engine(config, loaded.arch, loaded.dtype)
    executor = build_model_executor(loaded, config, layout, store=store)  # type: ignore[arg-type]
    return EngineCore(config, layout, ModelIdentity.of(loaded), loaded.tokenizer, executor)


@dataclass
class Pair:
    pe: EngineCore
    de: EngineCore
    pe_net: ShmTransport
    de_net: ShmTransport


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    return tmp_path / "shm"


def _pair(loaded: LoadedModel, shm_dir: Path, timeout_s: float = 10.0, pe_store=None, de_store=None, tmp=None) -> Pair:
    pe_net, de_net = ShmTransport(shm_dir, "pe"), ShmTransport(shm_dir, "de")
    pe, de = _core(loaded, pe_store, tmp), _core(loaded, de_store, tmp)
    pe.connect(pe_net, timeout_s=timeout_s)
    de.connect(de_net, timeout_s=timeout_s)
    return Pair(pe, de, pe_net, de_net)


@pytest.fixture
def pair(tiny_llama: LoadedModel, shm_dir: Path) -> Iterator[Pair]:
    p = _pair(tiny_llama, shm_dir)
    yield p
    p.pe_net.close()
    p.de_net.close()


def _colocated(loaded: LoadedModel, prompt: list[int], params: SamplingParams = PARAMS) -> list[int]:
    core = _core(loaded)
    core.add_request("ref", prompt, params)
    tokens: list[int] = []
    while core.has_unfinished():
        for delta in core.step():
            tokens += delta.new_token_ids
    return tokens


def _run_until(core: EngineCore, done, steps: int = 2000) -> list[RequestDelta]:
    """Step ``core`` until ``done(deltas so far)``."""
    deltas: list[RequestDelta] = []
    for _ in range(steps):
        deltas += core.step()
        if done(deltas):
            return deltas
    raise AssertionError(f"not done after {steps} steps: {deltas}")


def _settle(*cores: EngineCore, steps: int = 500) -> None:
    """Step until no stream is in flight on any core (their reports applied)."""
    for _ in range(steps):
        if all(c.kv.num_remote_in_flight == 0 for c in cores):
            return
        for c in cores:
            c.step()
    raise AssertionError("streams still in flight")


def _disaggregated(p: Pair, rid: str, prompt: list[int], params: SamplingParams = PARAMS, push: bool = False):
    """The dispatcher's three moves by hand: prepare the DE, hand the request to the PE, continue on the DE."""
    intake = IntakePlan(p.pe_net.address, recv_tag=1, push_tag=2 if push else None)
    answer = p.de.prepare_intake(rid, prompt, params, intake)
    plan = HandoffPlan(p.de_net.address, 1, answer.send_from_block, recv_tag=2, recv_blocks=answer.push_blocks)
    p.pe.add_request(rid, prompt, params, handoff=plan)
    first = _run_until(p.pe, lambda ds: any(d.finished for d in ds))[-1]
    assert first.finish_reason == "handoff" and len(first.new_token_ids) == 1
    p.de.continue_request(rid, Resume(tuple(first.new_token_ids), len(first.new_text)))
    rest = _run_until(p.de, lambda ds: any(d.finished for d in ds))
    return answer, first, rest


def test_a_handed_off_request_decodes_the_colocated_tokens_from_the_received_blocks(
    pair: Pair, tiny_llama: LoadedModel
) -> None:
    answer, first, rest = _disaggregated(pair, "r1", PROMPT)
    tokens = first.new_token_ids + [t for d in rest for t in d.new_token_ids]
    assert tokens == _colocated(tiny_llama, PROMPT)
    assert answer.send_from_block == 0  # the DE had nothing: the PE sent every full block
    # The DE found the whole prompt's full blocks, received from the PE, and computed only the tail.
    assert rest[-1].num_cached_tokens == 4 * BLOCK
    assert pair.de.stats().kv_tiers[PEER].hit_tokens == 4 * BLOCK
    _settle(pair.pe, pair.de)
    pe_stats, de_stats = pair.pe.stats(), pair.de.stats()
    assert pe_stats.remote_io.streams_sent == 1 and pe_stats.remote_io.layerwise_streams == 1
    assert de_stats.remote_io.blocks_received == 4
    # Nothing is held once the streams are reported: the PE's sent blocks and the DE's received ones are free.
    assert pair.pe.kv.pool.num_used == 0
    assert pair.de.kv.pool.num_used == 0 and pair.de.kv.pools[HOST].num_used == 0
