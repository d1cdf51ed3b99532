"""Prefill/decode disaggregation between two engines in this process, over a real shared-memory transport: a
prefill engine (PE) prefills and samples the first token while streaming the KV layer by layer to a decode
engine (DE), which decodes from the received blocks. Greedy outputs equal one engine's; streams that fail
free their blocks on both sides and the tokens are recomputed."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.builder import ModelIdentity, build_model_executor, size_engine
from boundless.engine.core import KV_STREAM_LOST, EngineCore, RequestDelta, Resume
from boundless.engine.handoff import HandoffPlan, IntakePlan
from boundless.engine.logprobs import PromptLogprobs
from boundless.engine.request import RequestStatus
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.structured_output import StructuredOutput
from boundless.kv.throttled_store import ThrottledStore
from boundless.kv.transfer import HOST, PEER
from boundless.model.loader import LoadedModel
from boundless.transport.shm import ShmTransport

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16
PROMPT = [(17 * j) % 300 + 3 for j in range(75)]  # 4 full blocks and 11 tokens


def _core(
    loaded: LoadedModel, disk: Path | None = None, speculative: str | None = None, kv: str = "auto"
) -> EngineCore:
    """An engine; with ``disk``, over the persistent store in that directory (shared by every engine given it,
    as the instances of one node share theirs); with ``speculative``, its ``--speculative-config``; its KV held in
    ``kv`` (``--kv-cache-dtype``)."""
    config = EngineConfig(
        model=ModelConfig(max_model_len=512),
        cache=CacheConfig(
            num_kv_blocks=48,
            kv_host_gb=0.004,
            kv_disk_path=str(disk) if disk else None,
            kv_write_policy="through",
            layerwise_load="on",  # the DE-read push test checks its layers go out as its load's arrive
            kv_cache_dtype=kv,
        ),
        scheduler=SchedulerConfig(policy="fcfs", speculative_config=speculative),
    )
    layout = size_engine(config, loaded.arch, loaded.dtype)
    executor = build_model_executor(loaded, config, layout)
    return EngineCore(config, layout, ModelIdentity.of(loaded, layout), loaded.tokenizer, executor)


@dataclass
class Pair:
    pe: EngineCore
    de: EngineCore
    pe_net: ShmTransport
    de_net: ShmTransport


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    return tmp_path / "shm"


def _pair(
    loaded: LoadedModel,
    shm_dir: Path,
    timeout_s: float = 10.0,
    disk: Path | None = None,
    speculative: str | None = None,
    kv: str = "auto",
) -> Pair:
    pe_net, de_net = ShmTransport(shm_dir, "pe"), ShmTransport(shm_dir, "de")
    pe, de = _core(loaded, disk, speculative, kv), _core(loaded, disk, speculative, kv)
    pe.connect(pe_net, timeout_s=timeout_s)
    de.connect(de_net, timeout_s=timeout_s)
    return Pair(pe, de, pe_net, de_net)


@pytest.fixture
def pair(tiny_llama: LoadedModel, shm_dir: Path) -> Iterator[Pair]:
    p = _pair(tiny_llama, shm_dir)
    yield p
    p.pe_net.close()
    p.de_net.close()


def _colocated(loaded: LoadedModel, prompt: list[int], params: SamplingParams = PARAMS, kv: str = "auto") -> list[int]:
    core = _core(loaded, kv=kv)
    core.add_request("ref", prompt, params)
    tokens: list[int] = []
    while core.has_unfinished():
        for delta in core.step():
            tokens += delta.new_token_ids
    return tokens


def _run_until(
    core: EngineCore, done, others: tuple[EngineCore, ...] = (), steps: int = 2000, step=EngineCore.step
) -> list[RequestDelta]:
    """Step ``core`` until ``done(its deltas so far)``, stepping ``others`` too (each instance runs its own loop)."""
    deltas: list[RequestDelta] = []
    for _ in range(steps):
        deltas += step(core)
        if done(deltas):
            return deltas
        for other in others:
            other.step()
    raise AssertionError(f"not done after {steps} steps: {deltas}")


def _settle(*cores: EngineCore, steps: int = 500) -> None:
    """Step until no stream is in flight on any core (their reports applied)."""
    for _ in range(steps):
        if all(c.kv.num_remote_in_flight == 0 for c in cores):
            return
        for c in cores:
            c.step()
    raise AssertionError("streams still in flight")


def _disaggregated(
    p: Pair,
    rid: str,
    prompt: list[int],
    params: SamplingParams = PARAMS,
    push: bool = False,
    before_prefill=lambda: None,
    after_arrival=lambda: None,
):
    """The dispatcher's moves by hand: under DE-read ask the PE what it holds, prepare the DE, hand the request to
    the PE (between ``before_prefill()`` and ``after_arrival()``), continue on the DE."""
    pe_holds = p.pe.memory_prefix_blocks(prompt) if push else 0
    intake = IntakePlan(p.pe_net.address, recv_tag=1, push_tag=2 if push else None, pe_holds=pe_holds)
    answer = p.de.prepare_intake(rid, prompt, params, intake)
    plan = HandoffPlan(
        p.de_net.address,
        1,
        answer.send_from_block,
        recv_tag=2,
        recv_blocks=answer.push_blocks,
        recv_from=answer.push_from,
    )
    before_prefill()
    p.pe.add_request(rid, prompt, params, handoff=plan)
    after_arrival()
    first = _run_until(p.pe, lambda ds: any(d.finished for d in ds), others=(p.de,))[-1]
    assert first.finish_reason == "handoff" and len(first.new_token_ids) == 1
    p.de.continue_request(rid, Resume(tuple(first.new_token_ids), len(first.new_text)))
    rest = _run_until(p.de, lambda ds: any(d.finished for d in ds), others=(p.pe,))
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


def _held_blocks(core: EngineCore, prompt: list[int], num_blocks: int) -> torch.Tensor:
    """The bytes of the first ``num_blocks`` full blocks of ``prompt`` that ``core`` holds in memory (device or host),
    all layers: what a handoff or a push must carry unchanged."""
    refs = core.kv.memory_prefix(None, prompt, num_blocks)
    assert len(refs) == num_blocks
    tiers = core.executor.tiers  # type: ignore[attr-defined]
    return torch.cat([tiers[r.tier].read_blocks([r.block_id]).view(torch.uint8) for r in refs], dim=3)


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_an_8_bit_handoff_carries_the_blocks_bit_exact_and_decodes_one_8_bit_engines_tokens(
    tiny_llama: LoadedModel, shm_dir: Path, kv: str
) -> None:
    p = _pair(tiny_llama, shm_dir, kv=kv)
    try:
        _, first, rest = _disaggregated(p, "r1", PROMPT)
        tokens = first.new_token_ids + [t for d in rest for t in d.new_token_ids]
        assert tokens == _colocated(tiny_llama, PROMPT, kv=kv)
        assert rest[-1].num_cached_tokens == 4 * BLOCK  # the DE decoded from the 4 received blocks
        _settle(p.pe, p.de)
        assert p.de.stats().remote_io.blocks_received == 4
        assert p.de.executor.runner.kv_cache.data.element_size() == 1  # type: ignore[attr-defined]
        assert torch.equal(_held_blocks(p.de, PROMPT, 4), _held_blocks(p.pe, PROMPT, 4))
    finally:
        p.pe_net.close()
        p.de_net.close()


def test_a_handed_off_request_speculates_on_its_decode_engine(tiny_llama: LoadedModel, shm_dir: Path) -> None:
    """With speculative decoding on both engines: the prefill engine samples the first token and hands off (no
    drafts), the decode engine speculates from the received prefix on; the tokens are the colocated plain ones."""
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    p = _pair(tiny_llama, shm_dir, speculative=spec)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        prompt = [100, 101, 102] * 25  # (the random model's greedy output repeats after it)
        _, first, rest = _disaggregated(p, "r1", prompt, params)
        tokens = first.new_token_ids + [t for d in rest for t in d.new_token_ids]
        assert tokens == _colocated(tiny_llama, prompt, params)
        assert p.pe.stats().spec_draft_tokens == 0 and p.de.stats().spec_accepted_tokens > 0
        assert len(rest) < 39  # kept drafts: fewer steps than tokens
    finally:
        p.pe_net.close()
        p.de_net.close()


def test_a_structured_request_keeps_its_grammar_across_the_handoff(pair: Pair, tiny_llama: LoadedModel) -> None:
    """The prefill engine draws the first token under the grammar; the decode engine's sampler replays it into a
    matcher of its own and goes on: the colocated engine's tokens, valid JSON (a random model's)."""
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    params = SamplingParams(temperature=0.0, max_tokens=200, structured=StructuredOutput.json_schema(schema))
    _, first, rest = _disaggregated(pair, "s1", PROMPT, params)
    tokens = first.new_token_ids + [t for d in rest for t in d.new_token_ids]
    assert tokens == _colocated(tiny_llama, PROMPT, params)
    assert rest[-1].finish_reason == "stop"
    assert json.loads(first.new_text + "".join(d.new_text for d in rest))["color"] in ("red", "green", "blue")


def _colocated_prompt_logprobs(loaded: LoadedModel, prompt: list[int], params: SamplingParams) -> PromptLogprobs:
    core = _core(loaded)
    core.add_request("ref", prompt, params)
    scored = None
    while core.has_unfinished():
        for delta in core.step():
            scored = delta.prompt_logprobs if scored is None else scored
    assert scored is not None
    return scored


def _assert_same_prompt_logprobs(ours: PromptLogprobs | None, theirs: PromptLogprobs) -> None:
    assert ours is not None and len(ours) == len(theirs) and ours[0] is None and theirs[0] is None
    for a, b in zip(ours[1:], theirs[1:], strict=True):
        assert a is not None and b is not None and (a.token_id, a.rank) == (b.token_id, b.rank)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def test_the_prefill_engines_first_delta_carries_the_prompts_logprobs(pair: Pair, tiny_llama: LoadedModel) -> None:
    """The prefill engine scores the prompt (every position: it takes no cached block) and its handoff delta carries
    the prompt logprobs, those of one engine; the decode engine, which computes only the tail, scores nothing."""
    params = dataclasses.replace(PARAMS, prompt_logprobs=2)
    _, first, rest = _disaggregated(pair, "lp", PROMPT, params)
    _assert_same_prompt_logprobs(first.prompt_logprobs, _colocated_prompt_logprobs(tiny_llama, PROMPT, params))
    assert all(d.prompt_logprobs is None for d in rest)
    assert first.new_token_ids + [t for d in rest for t in d.new_token_ids] == _colocated(tiny_llama, PROMPT)


CONTEXT = [(29 * j) % 300 + 3 for j in range(70)]  # a previous turn's context: 4 full blocks go to the store
APPEND = [(7 * j) % 300 + 5 for j in range(40)]  # this turn's new input


def _store_context(loaded: LoadedModel, disk: Path, kv: str = "auto") -> EngineCore:
    """A previous turn served by some engine: its context's full blocks are written through to the store."""
    writer = _core(loaded, disk, kv=kv)
    writer.add_request("turn-1", CONTEXT, PARAMS)
    while writer.has_unfinished():
        writer.step()
    writer.executor.kv_io.flush()
    return writer


# With an fp8 KV cache too: the store's 8-bit blocks go from the disk to the DE, on to the PE and back as their bytes.
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_de_read_loads_the_prefix_on_the_decode_engine_and_sends_only_new_blocks_back(
    tiny_llama: LoadedModel, shm_dir: Path, tmp_path: Path, kv: str
) -> None:
    disk = tmp_path / "store"
    writer = _store_context(tiny_llama, disk, kv)
    p = _pair(tiny_llama, shm_dir, disk=disk, kv=kv)
    try:
        prompt = CONTEXT + APPEND  # 6 full blocks: 4 stored, 2 new
        answer, first, rest = _disaggregated(p, "r", prompt, push=True)
        tokens = first.new_token_ids + [t for d in rest for t in d.new_token_ids]
        assert tokens == _colocated(tiny_llama, prompt, kv=kv)
        assert answer.push_blocks == 4 and answer.send_from_block == 4
        pe, de = p.pe.stats(), p.de.stats()
        # The DE read the store (its node's storage link); the PE read nothing and got the prefix from the DE.
        assert de.disk_io.blocks_loaded == 4 and pe.disk_io.blocks_loaded == 0
        assert pe.kv_tiers[PEER].hit_tokens == 4 * BLOCK
        # Only the new blocks went back: the DE found its loaded prefix and the PE's two blocks.
        assert rest[-1].num_cached_tokens == 6 * BLOCK
        assert de.kv_tiers["disk"].hit_tokens == 4 * BLOCK and de.kv_tiers[PEER].hit_tokens == 2 * BLOCK
        _settle(p.pe, p.de)
        assert p.pe.stats().remote_io.blocks_sent == 2 and p.de.stats().remote_io.blocks_sent == 4
        # Every engine holds the stored context's blocks as the engine that computed them did, to the bit.
        computed = _held_blocks(writer, CONTEXT, 4)
        assert torch.equal(_held_blocks(p.pe, prompt, 4), computed) and torch.equal(
            _held_blocks(p.de, prompt, 4), computed
        )
    finally:
        p.pe_net.close()
        p.de_net.close()


def _hold_de_storage_link(p: Pair, held_link: type):
    """The DE's storage link, held: its layerwise load's layers cross (and its push sends them on) only when let
    through."""
    link = held_link()
    kv_io = p.de.executor.kv_io
    kv_io.store = ThrottledStore(kv_io.store, link.transfer, link.transfer_parts)
    return link


def _when(condition, then=lambda: None, timeout_s: float = 30.0) -> threading.Thread:
    """A thread that waits until ``condition()`` holds (another thread steps the engines meanwhile), then ``then()``."""

    def run() -> None:
        deadline = time.monotonic() + timeout_s
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.001)
        then()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_de_read_push_lands_layer_by_layer_under_the_prefill_engines_forward_pass(
    tiny_llama: LoadedModel, shm_dir: Path, tmp_path: Path, held_link: type
) -> None:
    disk = tmp_path / "store"
    _store_context(tiny_llama, disk)
    p = _pair(tiny_llama, shm_dir, disk=disk)
    link = _hold_de_storage_link(p, held_link)
    de_sent, pe_recv = p.de.executor.remote.stats, p.pe.executor.remote
    count_and_layer_zero = 8 + 4 * p.de.executor.kv_io._layer_block_bytes()  # the count, layer 0 of four blocks
    seen: dict[str, object] = {}

    def look_then_let_through() -> None:
        # The PE's forward pass waits at layer 1: only the count and layer 0 of the push have crossed.
        gates = {id(g): g for g in pe_recv.recv_gates(range(p.pe.kv.pools[HOST].num_blocks)).values()}.values()
        seen.update(
            bytes_sent=de_sent.bytes_sent,
            opened=[g.opened for g in gates],
            receiving=p.pe.kv.is_receiving("r"),
            running=p.pe.scheduler.requests["r"].status,
        )
        link.let_through(10_000)

    def arrive() -> None:
        link.let_through(1)  # layer 0 of the DE's load crosses its storage link (and goes on to the PE)
        seen["watcher"] = _when(lambda: pe_recv.stats.recv_layer_waits >= 1, look_then_let_through)

    try:
        prompt = CONTEXT + APPEND
        answer, first, rest = _disaggregated(p, "r", prompt, push=True, after_arrival=arrive)
        seen["watcher"].join()  # type: ignore[attr-defined]
        tokens = first.new_token_ids + [t for d in rest for t in d.new_token_ids]
        assert tokens == _colocated(tiny_llama, prompt)
        assert answer.push_blocks == 4 and p.de.stats().disk_io.layerwise_loads == 1
        # The PE ran the request's forward pass before the push's layer 1 had landed: the blocks were named at the
        # count (not receiving any more), the request was running, and its forward pass waited at layer 1.
        assert seen["bytes_sent"] == count_and_layer_zero
        assert seen["opened"] == [1] and not seen["receiving"] and seen["running"] is RequestStatus.RUNNING
        pe = p.pe.stats()
        assert pe.remote_io.counted_recvs == 1 and pe.remote_io.recv_layer_waits >= 1
        assert pe.kv_tiers[PEER].hit_tokens == 4 * BLOCK and pe.disk_io.blocks_loaded == 0
        _settle(p.pe, p.de)
        assert p.pe.kv.pool.num_used == 0 and p.pe.kv.pools[HOST].num_used == 0
    finally:
        link.let_through(10_000)
        p.pe_net.close()
        p.de_net.close()


def _step_or_fail(core: EngineCore) -> list[RequestDelta]:
    """One step as the engine loop runs it: a step that raises fails its requests (``EngineCore.fail_step``)."""
    sched = core.schedule()
    if sched.is_empty:
        return []
    try:
        result = core.execute(sched)
    except Exception as e:
        return core.fail_step(sched, e)
    return core.finish_step(sched, result)


@pytest.mark.parametrize("fault", ["gone", "hung"])
def test_a_decode_engine_gone_or_hung_mid_push_fails_the_prefill_which_is_placed_again_with_the_same_tokens(
    tiny_llama: LoadedModel, shm_dir: Path, tmp_path: Path, held_link: type, fault: str
) -> None:
    disk = tmp_path / "store"
    _store_context(tiny_llama, disk)
    p = _pair(tiny_llama, shm_dir, disk=disk)
    if fault == "hung":  # the push stops after layer 0 for longer than the PE waits for a stream
        p.pe.executor.remote.timeout_s = 2.0
        p.de.executor.remote.timeout_s = 4.0  # (its push waits for its storage link past that, then goes on)
    link = _hold_de_storage_link(p, held_link)
    prompt = CONTEXT + APPEND
    de2_net = ShmTransport(shm_dir, "de2")
    try:
        intake = IntakePlan(p.pe_net.address, recv_tag=1, push_tag=2)
        answer = p.de.prepare_intake("r", prompt, PARAMS, intake)
        plan = HandoffPlan(p.de_net.address, 1, answer.send_from_block, 2, answer.push_blocks, answer.push_from)
        p.pe.add_request("r", prompt, PARAMS, handoff=plan)
        link.let_through(1)
        # The DE dies (or hangs) once the PE's forward pass waits for the push's layer 1.
        waiting = _when(
            lambda: p.pe.executor.remote.stats.recv_layer_waits >= 1,
            p.de_net.close if fault == "gone" else lambda: None,
        )
        deltas = _run_until(p.pe, lambda ds: any(d.finished for d in ds), others=(p.de,), step=_step_or_fail)
        waiting.join()
        # The gate failed: the step failed its request (nothing reached a client) with the reason a dispatcher
        # places the call again for.
        assert [(d.finish_reason, d.stop_reason, d.new_token_ids) for d in deltas] == [("error", KV_STREAM_LOST, [])]
        link.let_through(10_000)  # the dead DE's sender finds its transport closed; a hung one's goes on, unheard
        _settle(p.pe)
        # The PE's blocks are free and the push's names gone: nothing can read the KV that never came.
        remote = p.pe.stats().remote_io
        assert remote.recv_failures == 1 and remote.recv_timeouts == (fault == "hung")
        assert p.pe.kv.pool.num_used == 0 and p.pe.kv.pools[HOST].num_used == 0
        assert p.pe.memory_prefix_blocks(prompt) == 0
        # Placed again on another DE: the same tokens as one engine.
        de2 = _core(tiny_llama, disk)
        de2.connect(de2_net, timeout_s=10.0)
        again = Pair(p.pe, de2, p.pe_net, de2_net)
        hits_before = p.pe.stats().kv_tiers[PEER].hit_tokens
        answer, first, rest = _disaggregated(again, "r", prompt, push=True)
        tokens = first.new_token_ids + [t for d in rest for t in d.new_token_ids]
        assert tokens == _colocated(tiny_llama, prompt)
        # The new DE read the store and pushed the prefix again; the PE used it as it landed.
        assert answer.push_blocks == 4 and p.pe.stats().kv_tiers[PEER].hit_tokens - hits_before == 4 * BLOCK
        # The first DE's push ended (its peer gone, or its late layers swallowed by the PE's transport) and its half
        # is dropped (the dispatcher's abort): it holds nothing.
        _settle(p.de)
        p.de.abort("r")
        assert p.de.kv.pool.num_used == 0 and p.de.kv.pools[HOST].num_used == 0
    finally:
        link.let_through(10_000)
        p.pe_net.close()
        p.de_net.close()
        de2_net.close()


MORE = [(11 * j) % 300 + 7 for j in range(30)]  # the turn after: CONTEXT + APPEND + MORE has 8 full blocks


def _pe_holding_context(loaded: LoadedModel, shm_dir: Path, disk: Path) -> Pair:
    """A DE-read turn's setup: the store holds CONTEXT + APPEND's 6 full blocks (an earlier turn), and the PE holds
    CONTEXT's 4 in memory (it prefilled them), the DE nothing."""
    writer = _core(loaded, disk)
    writer.add_request("turn-1", CONTEXT + APPEND, PARAMS)
    while writer.has_unfinished():
        writer.step()
    writer.executor.kv_io.flush()
    p = _pair(loaded, shm_dir, disk=disk)
    p.pe.add_request("warm", CONTEXT, SamplingParams(temperature=0.0, max_tokens=1))
    while p.pe.has_unfinished():
        p.pe.step()
    assert p.pe.memory_prefix_blocks(CONTEXT + APPEND + MORE) == 4
    return p


def test_de_read_pushes_only_the_blocks_the_prefill_engine_lacks(
    tiny_llama: LoadedModel, shm_dir: Path, tmp_path: Path
) -> None:
    p = _pe_holding_context(tiny_llama, shm_dir, tmp_path / "store")
    try:
        prompt = CONTEXT + APPEND + MORE  # 8 full blocks: 4 in the PE's memory, 6 stored
        loaded_before = p.pe.stats().disk_io.blocks_loaded
        answer, first, rest = _disaggregated(p, "r", prompt, push=True)
        assert first.new_token_ids + [t for d in rest for t in d.new_token_ids] == _colocated(tiny_llama, prompt)
        # The DE loaded and pushed only the gap, blocks 4 and 5; the PE used its own four and read nothing.
        assert (answer.push_from, answer.push_blocks) == (4, 2)
        pe, de = p.pe.stats(), p.de.stats()
        assert de.disk_io.blocks_loaded == 2 and pe.disk_io.blocks_loaded == loaded_before
        assert pe.kv_tiers[PEER].hit_tokens == 2 * BLOCK
        # The DE, holding nothing, got the rest of the prompt from the PE at the handoff.
        assert answer.send_from_block == 0 and rest[-1].num_cached_tokens == 8 * BLOCK
        _settle(p.pe, p.de)
        assert p.de.stats().remote_io.blocks_sent == 2
    finally:
        p.pe_net.close()
        p.de_net.close()


def test_a_prefill_engine_scoring_the_prompt_computes_the_blocks_it_holds_and_is_pushed(
    tiny_llama: LoadedModel, shm_dir: Path, tmp_path: Path
) -> None:
    """A dispatcher plans no DE-read push for a call that scores its prompt (it reads nothing), but should blocks come
    (the PE holds some, the DE pushes others) its prefill engine still computes and scores every position."""
    p = _pe_holding_context(tiny_llama, shm_dir, tmp_path / "store")
    try:
        prompt = CONTEXT + APPEND + MORE
        params = dataclasses.replace(PARAMS, prompt_logprobs=1)
        answer, first, rest = _disaggregated(p, "lp", prompt, params, push=True)
        assert answer.push_blocks == 2  # (blocks 4 and 5, which the prefill engine lacked)
        _assert_same_prompt_logprobs(first.prompt_logprobs, _colocated_prompt_logprobs(tiny_llama, prompt, params))
        assert first.num_cached_tokens == 0
        assert first.new_token_ids + [t for d in rest for t in d.new_token_ids] == _colocated(tiny_llama, prompt)
    finally:
        p.pe_net.close()
        p.de_net.close()


class _DoneLate:
    """A stream's last layer's receive that says "not done" until the trailer after it is done, and once more then:
    the transport finishing both just after the receiver looked at the layer, while the receiver is between landing
    the stream's layers and seeing it whole."""

    def __init__(self, handle, posted: list) -> None:
        self.handle = handle
        self.posted = posted  # the stream's receives as posted: the trailer's is the last, once posted
        self.hidden = True

    def done(self) -> bool:
        if self.hidden:
            trailer = self.posted[-1]
            self.hidden = trailer is self or not trailer.done()
            return False
        return self.handle.done()

    def wait(self, timeout_s: float):
        return self.handle.wait(timeout_s)


@pytest.mark.timeout(60)  # without the landing, the forward pass waits forever for a layer its stream never opens
def test_a_pushs_last_layer_finished_while_its_receiver_looked_elsewhere_is_landed_before_use(
    tiny_llama: LoadedModel, shm_dir: Path, tmp_path: Path
) -> None:
    p = _pe_holding_context(tiny_llama, shm_dir, tmp_path / "store")
    posted: list[object] = []
    recv = p.pe_net.recv
    last_layer = p.pe.executor.num_layers  # the push's messages: its count, its layers, its trailer

    def late_recv(peer: str, tag: int, tensor):
        handle = recv(peer, tag, tensor)
        if tag == 2:
            posted.append(_DoneLate(handle, posted) if len(posted) == last_layer else handle)
            return posted[-1]
        return handle

    p.pe_net.recv = late_recv  # type: ignore[method-assign]
    try:
        prompt = CONTEXT + APPEND + MORE
        answer, first, rest = _disaggregated(p, "r", prompt, push=True)
        assert answer.push_blocks == 2 and len(posted) == last_layer + 2
        assert first.new_token_ids + [t for d in rest for t in d.new_token_ids] == _colocated(tiny_llama, prompt)
        assert p.pe.stats().kv_tiers[PEER].hit_tokens == 2 * BLOCK
    finally:
        p.pe_net.close()
        p.de_net.close()


def test_a_prefill_engines_blocks_gone_before_its_prefill_are_read_from_the_store(
    tiny_llama: LoadedModel, shm_dir: Path, tmp_path: Path
) -> None:
    p = _pe_holding_context(tiny_llama, shm_dir, tmp_path / "store")
    try:
        prompt = CONTEXT + APPEND + MORE
        loaded_before = p.pe.stats().disk_io.blocks_loaded
        # The PE said it holds four blocks, then lost them all before the request came.
        answer, first, rest = _disaggregated(p, "r", prompt, push=True, before_prefill=p.pe.kv.reset_prefix_cache)
        assert (answer.push_from, answer.push_blocks) == (4, 2)
        assert first.new_token_ids + [t for d in rest for t in d.new_token_ids] == _colocated(tiny_llama, prompt)
        # It read them from its store rather than computing them, and took the DE's push after them.
        assert p.pe.stats().disk_io.blocks_loaded == loaded_before + 4
        assert p.pe.stats().kv_tiers[PEER].hit_tokens == 2 * BLOCK
    finally:
        p.pe_net.close()
        p.de_net.close()


def test_a_prefill_engine_holds_its_prefix_for_the_push_while_everything_else_is_evicted(
    tiny_llama: LoadedModel, shm_dir: Path, tmp_path: Path
) -> None:
    p = _pe_holding_context(tiny_llama, shm_dir, tmp_path / "store")
    prompt = CONTEXT + APPEND + MORE
    fillers = []

    def evict_everything() -> None:  # other calls take every block memory would give up, for a few steps
        for _ in range(3):
            for pool in (p.pe.kv.pool, p.pe.kv.pools[HOST]):
                fillers.append((pool, pool.allocate(pool.num_free)))
            p.pe.step()  # the evictions' copies run and let their blocks go
        assert p.pe.memory_prefix_blocks(prompt) == 4  # the call's four blocks stayed
        for pool, blocks in fillers:
            pool.free(blocks)

    try:
        loaded_before = p.pe.stats().disk_io.blocks_loaded
        _, first, rest = _disaggregated(p, "r", prompt, push=True, after_arrival=evict_everything)
        assert first.new_token_ids + [t for d in rest for t in d.new_token_ids] == _colocated(tiny_llama, prompt)
        assert p.pe.stats().disk_io.blocks_loaded == loaded_before and first.num_cached_tokens == 6 * BLOCK
    finally:
        p.pe_net.close()
        p.de_net.close()


def test_a_prefill_engines_blocks_gone_and_not_stored_are_recomputed(tiny_llama: LoadedModel, shm_dir: Path) -> None:
    p = _pair(tiny_llama, shm_dir)  # no store: what leaves memory is gone
    try:
        p.pe.add_request("warm", CONTEXT, SamplingParams(temperature=0.0, max_tokens=1))
        while p.pe.has_unfinished():
            p.pe.step()
        prompt = CONTEXT + APPEND
        answer, first, rest = _disaggregated(p, "r", prompt, push=True, before_prefill=p.pe.kv.reset_prefix_cache)
        assert answer.push_blocks == 0  # nothing stored to push; the PE was to use its own four blocks
        assert first.new_token_ids + [t for d in rest for t in d.new_token_ids] == _colocated(tiny_llama, prompt)
        assert first.num_cached_tokens == 0  # it computed the whole prompt
    finally:
        p.pe_net.close()
        p.de_net.close()


def test_a_stored_block_failing_its_checksum_is_recomputed_on_both_sides(
    tiny_llama: LoadedModel, shm_dir: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "store"
    writer = _store_context(tiny_llama, disk)
    key = writer.kv.block_hashes("names", CONTEXT)[2]
    (path,) = disk.rglob(f"{key.hex()}.kv")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the payload of the context's third block
    path.write_bytes(bytes(data))
    p = _pair(tiny_llama, shm_dir, disk=disk)
    try:
        prompt = CONTEXT + APPEND
        answer, first, rest = _disaggregated(p, "r", prompt, push=True)
        tokens = first.new_token_ids + [t for d in rest for t in d.new_token_ids]
        assert tokens == _colocated(tiny_llama, prompt)
        assert answer.push_blocks == 4  # the probe saw four files; the third fails when it is read
        de = p.de.stats()
        assert p.de.executor.kv_io.store.stats().checksum_failures == 1 and de.disk_io.blocks_loaded == 2
        # The DE pushed the two good blocks; the PE recomputed from the third, and so did the DE.
        assert p.pe.stats().kv_tiers[PEER].hit_tokens == 2 * BLOCK
        assert rest[-1].num_cached_tokens == 2 * BLOCK
    finally:
        p.pe_net.close()
        p.de_net.close()


def test_a_stream_nobody_sends_times_out_and_frees_the_decode_engines_blocks(
    tiny_llama: LoadedModel, shm_dir: Path
) -> None:
    p = _pair(tiny_llama, shm_dir, timeout_s=0.3)
    try:
        reference = _colocated(tiny_llama, PROMPT)
        p.de.prepare_intake("r", PROMPT, PARAMS, IntakePlan(p.pe_net.address, recv_tag=1))
        assert p.de.kv.pools[HOST].num_used == 4  # reserved for the four blocks the PE will not send
        _settle(p.de)  # the PE never prefills it: the receive times out
        assert p.de.stats().remote_io.recv_timeouts == 1 and p.de.kv.pools[HOST].num_used == 0
        # Given its first token, the request is recomputed: the same tokens, nothing from the peer.
        p.de.continue_request("r", Resume((reference[0],), 0))
        rest = _run_until(p.de, lambda ds: any(d.finished for d in ds))
        assert reference[:1] + [t for d in rest for t in d.new_token_ids] == reference
        assert rest[-1].num_cached_tokens == 0
    finally:
        p.pe_net.close()
        p.de_net.close()


def test_a_send_to_a_hung_decode_engine_times_out_and_frees_the_prefill_engines_blocks(
    tiny_llama: LoadedModel, shm_dir: Path
) -> None:
    # A decode engine that hangs: its socket takes connections into its backlog and never answers, so the PE's
    # first message fills the slot and no ack ever frees it for the next.
    shm_dir.mkdir(parents=True)
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    hung.bind(str(shm_dir / "hung.sock"))
    hung.listen(8)
    pe_net = ShmTransport(shm_dir, "pe", inline_max=0)
    pe = _core(tiny_llama)
    pe.connect(pe_net, timeout_s=0.3)
    try:
        pe.add_request("r", PROMPT, PARAMS, handoff=HandoffPlan(str(shm_dir / "hung"), 1, 0))
        first = _run_until(pe, lambda ds: any(d.finished for d in ds))[-1]
        assert first.finish_reason == "handoff" and first.new_token_ids == _colocated(tiny_llama, PROMPT)[:1]
        assert pe.kv.pool.num_used == 4  # the request is done; the send still holds its four blocks
        _settle(pe)
        stats = pe.stats().remote_io
        assert stats.send_failures == 1 and stats.streams_sent == 0 and pe.kv.pool.num_used == 0
    finally:
        pe_net.close()
        hung.close()


def test_a_decode_engine_gone_before_the_handoff_fails_the_stream_and_another_decodes_by_recompute(
    tiny_llama: LoadedModel, shm_dir: Path
) -> None:
    p = _pair(tiny_llama, shm_dir)
    try:
        reference = _colocated(tiny_llama, PROMPT)
        answer = p.de.prepare_intake("r", PROMPT, PARAMS, IntakePlan(p.pe_net.address, recv_tag=1))
        p.pe.add_request("r", PROMPT, PARAMS, handoff=HandoffPlan(p.de_net.address, 1, answer.send_from_block))
        p.de_net.close()  # the DE's process is gone: its socket is closed and removed
        first = _run_until(p.pe, lambda ds: any(d.finished for d in ds))[-1]
        _settle(p.pe)
        assert p.pe.stats().remote_io.send_failures == 1 and p.pe.kv.pool.num_used == 0
        # The dispatcher resends the request, with its first token, to another DE: a resumed request.
        other = _core(tiny_llama)
        other.add_request("r", PROMPT, PARAMS, resume=Resume(tuple(first.new_token_ids), len(first.new_text)))
        rest = _run_until(other, lambda ds: any(d.finished for d in ds))
        assert first.new_token_ids + [t for d in rest for t in d.new_token_ids] == reference
    finally:
        p.pe_net.close()


def test_a_prefill_engine_gone_mid_push_frees_the_decode_engines_blocks_at_once(
    tiny_llama: LoadedModel, shm_dir: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "store"
    _store_context(tiny_llama, disk)
    p = _pair(tiny_llama, shm_dir, timeout_s=30.0, disk=disk)
    try:
        prompt = CONTEXT + APPEND
        intake = IntakePlan(p.pe_net.address, recv_tag=1, push_tag=2)
        answer = p.de.prepare_intake("r", prompt, PARAMS, intake)
        assert answer.push_blocks == 4 and p.de.kv.pools[HOST].num_used == 2  # reserved for the PE's two blocks
        p.pe_net.close()  # the PE dies before it could send anything
        # The push fails once the DE's loads are done (the PE is gone), and so does the receive, long before its
        # timeout.
        for _ in range(500):
            if p.de.stats().remote_io.send_failures and not p.de.kv.num_remote_in_flight:
                break
            p.de.step()
        stats = p.de.stats().remote_io
        assert stats.send_failures == 1 and stats.recv_failures == 1 and stats.recv_timeouts == 0
        # The loaded prefix stays in host memory, held for the request; nothing else is.
        assert p.de.kv.pools[HOST].num_used == 4
        p.de.abort("r")  # the dispatcher re-places the request elsewhere
        assert p.de.kv.pools[HOST].num_used == 0 and p.de.kv.pool.num_used == 0
    finally:
        p.de_net.close()


def test_a_decode_engine_without_host_room_asks_for_nothing_and_computes_the_prompt(
    tiny_llama: LoadedModel, shm_dir: Path
) -> None:
    p = _pair(tiny_llama, shm_dir)
    try:
        host = p.de.kv.pools[HOST]
        filler = host.allocate(host.num_free - 2)  # room for two blocks only; the prompt has four
        answer, first, rest = _disaggregated(p, "r", PROMPT)
        assert answer.send_from_block == 4 and rest[-1].num_cached_tokens == 0
        assert first.new_token_ids + [t for d in rest for t in d.new_token_ids] == _colocated(tiny_llama, PROMPT)
        assert p.pe.stats().remote_io.streams_sent == 0  # the PE sent nothing
        host.free(filler)
    finally:
        p.pe_net.close()
        p.de_net.close()


def test_an_agents_next_turn_gets_only_the_blocks_its_decode_engine_lacks(pair: Pair, tiny_llama: LoadedModel) -> None:
    _, first, rest = _disaggregated(pair, "turn-1", PROMPT)
    output = first.new_token_ids + [t for d in rest for t in d.new_token_ids]
    prompt = PROMPT + output + APPEND  # 123 tokens: 7 full blocks
    answer, first, rest = _disaggregated(pair, "turn-2", prompt)
    # The DE computed the first turn's 82 tokens of KV: 5 full blocks it holds for the next turn.
    assert answer.send_from_block == 5
    assert first.new_token_ids + [t for d in rest for t in d.new_token_ids] == _colocated(tiny_llama, prompt)
    assert rest[-1].num_cached_tokens == 7 * BLOCK
    _settle(pair.pe, pair.de)
    assert pair.pe.stats().remote_io.blocks_sent == 4 + 2


def test_a_prepared_request_whose_first_token_never_comes_is_dropped(tiny_llama: LoadedModel, shm_dir: Path) -> None:
    p = _pair(tiny_llama, shm_dir, timeout_s=0.2)
    try:
        p.de.prepare_intake("r", PROMPT, PARAMS, IntakePlan(p.pe_net.address, recv_tag=1))
        for _ in range(200):
            if not p.de.has_work():
                break
            p.de.step()
            time.sleep(0.01)
        assert "r" not in p.de.scheduler.requests  # dropped after twice the timeout
        assert p.de.kv.pools[HOST].num_used == 0 and p.de.kv.pool.num_used == 0
        assert not p.de.continue_request("r", Resume((1,), 0))  # too late: the dispatcher resends it
    finally:
        p.pe_net.close()
        p.de_net.close()
