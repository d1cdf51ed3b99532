"""Multi-step decoding (``--num-scheduler-steps``) on the real engine: the same tokens as single steps, exact stops,
exact block accounting, fewer scheduler calls."""

from __future__ import annotations

import random
import threading

import pytest

from boundless.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.async_engine import EngineLoop
from boundless.engine.attention_time import ChunkShape
from boundless.engine.core import EngineCore, RequestDelta
from boundless.engine.multi_step import window_shapes
from boundless.engine.request import Request, RequestStatus
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from boundless.kv.manager import KVCacheManager
from boundless.model.loader import LoadedModel
from boundless.programs.policy import FCFSPolicy

PROMPTS = [list(range(5, 5 + n)) for n in (7, 19, 33, 12)]


def _core(loaded: LoadedModel, k: int, num_blocks: int = 64, prefix_caching: bool = True) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(max_model_len=min(256, num_blocks * 16)),
        cache=CacheConfig(num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(policy="fcfs", num_scheduler_steps=k),
    )
    return EngineCore.from_model(loaded, config)


class Run:
    """An engine driven to the end: each request's tokens, finish reason and stop reason, and the step calls made."""

    def __init__(self, core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> None:
        self.tokens: dict[str, list[int]] = {rid: [] for rid in requests}
        self.text: dict[str, str] = {rid: "" for rid in requests}
        self.reasons: dict[str, tuple[str | None, str | int | None]] = {}
        self.calls = 0
        for rid, (prompt, params) in requests.items():
            core.add_request(rid, prompt, params)
        while core.has_unfinished():
            self.calls += 1
            for delta in core.step():
                self.tokens[delta.request_id] += delta.new_token_ids
                self.text[delta.request_id] += delta.new_text
                if delta.finished:
                    self.reasons[delta.request_id] = (delta.finish_reason, delta.stop_reason)
            _assert_blocks_match_progress(core)
        assert core.kv.pool.num_used == 0  # every block given back


def _assert_blocks_match_progress(core: EngineCore) -> None:
    """Between steps a running request holds exactly the blocks of its tokens with KV (no slot left over from a
    window, none missing)."""
    kv = core.kv
    for request in core.scheduler.running:
        assert kv.num_allocated_blocks(request.request_id) == kv.blocks_for_tokens(request.num_computed_tokens)
        assert request.num_computed_tokens == request.num_tokens - 1


def _greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def _requests(max_tokens: tuple[int, ...] = (5, 13, 30, 22), **kw: object) -> dict:
    return {f"r{i}": (p, _greedy(m, **kw)) for i, (p, m) in enumerate(zip(PROMPTS, max_tokens, strict=True))}


@pytest.mark.parametrize("k", [2, 4, 8])
def test_greedy_tokens_are_those_of_single_steps_with_fewer_step_calls(tiny_llama: LoadedModel, k: int) -> None:
    one = Run(_core(tiny_llama, 1), _requests())
    many = Run(_core(tiny_llama, k), _requests())
    assert many.tokens == one.tokens
    assert many.text == one.text
    assert many.reasons == one.reasons == {rid: ("length", None) for rid in one.tokens}
    assert many.calls < one.calls  # decodes ran k to a step call


def test_seeded_sampling_gives_the_same_tokens_as_single_steps(tiny_llama: LoadedModel) -> None:
    def seeded() -> dict:
        return {
            f"s{i}": (p, SamplingParams(temperature=0.9, top_p=0.9, seed=11 + i, max_tokens=17, ignore_eos=True))
            for i, p in enumerate(PROMPTS)
        }

    one = Run(_core(tiny_llama, 1), seeded())
    many = Run(_core(tiny_llama, 4), seeded())
    assert many.tokens == one.tokens and many.calls < one.calls


def test_a_stop_token_or_string_inside_a_window_ends_the_request_there(tiny_llama: LoadedModel) -> None:
    free = Run(_core(tiny_llama, 1), _requests())
    out = free.tokens["r2"]  # 30 greedy tokens: stop at the 11th (inside the second window of 8)
    stop_token = out[10]
    first = out.index(stop_token)
    stop_text = free.text["r3"][5:9]
    for params in ({"stop_token_ids": [stop_token]}, {"stop": [stop_text]}):
        one = Run(_core(tiny_llama, 1), _requests(**params))
        many = Run(_core(tiny_llama, 8), _requests(**params))
        assert many.tokens == one.tokens and many.text == one.text and many.reasons == one.reasons
    assert Run(_core(tiny_llama, 8), _requests(stop_token_ids=[stop_token])).tokens["r2"] == out[: first + 1]


def test_under_memory_pressure_preemptions_keep_the_tokens_and_the_blocks_exact(tiny_llama: LoadedModel) -> None:
    # Six 16-token blocks for four requests that grow to 12-63 tokens (ten blocks): some are preempted and recomputed.
    one = Run(_core(tiny_llama, 1, num_blocks=6), _requests())
    core = _core(tiny_llama, 8, num_blocks=6)
    many = Run(core, _requests())
    assert core.scheduler.stats.num_preemptions > 0 and core.counters.steps > many.calls  # preempted, windows ran
    assert many.tokens == one.tokens and many.reasons == one.reasons


def test_the_blocks_a_window_fills_are_named_for_the_next_call(tiny_llama: LoadedModel) -> None:
    """A follow-up whose prompt is the first call's prompt and output finds those blocks cached, as after single
    steps: the window names the blocks its passes filled before the request's blocks are freed."""
    cached = {}
    for k in (1, 8):
        core = _core(tiny_llama, k)
        first = Run(core, {"a": (PROMPTS[2], _greedy(32))})
        follow = PROMPTS[2] + first.tokens["a"] + [9, 9, 9]
        core.add_request("b", follow, _greedy(1))
        while core.has_unfinished():
            core.step()
        cached[k] = core.scheduler.stats.num_prompt_tokens_cached
    # 33 + 32 - 1 tokens with KV: 4 full blocks, the 4th filled by the last window (it began at 58 tokens known).
    assert cached[8] == cached[1] == 64


def test_the_scheduler_plans_a_window_only_for_a_batch_of_decodes_with_room() -> None:
    kv = KVCacheManager(16, 4, True, "fp")
    s = Scheduler(kv, FCFSPolicy(), lambda: 0.0, max_num_batched_tokens=32, max_num_seqs=8, num_scheduler_steps=4)
    s.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=3), arrival_time=0.0))
    out = s.schedule()  # a prompt: an ordinary step
    assert out.window == 1 and [c.num_steps for c in out.chunks] == [1]
    _apply(s, out)
    s.add(Request("b", list(range(10, 20)), SamplingParams(max_tokens=8), arrival_time=0.0))
    out = s.schedule()  # a's decode with b's prompt: an ordinary step
    assert out.window == 1 and [c.num_steps for c in out.chunks] == [1, 1]
    _apply(s, out)
    out = s.schedule()  # decodes only: a has one token left to produce, b seven
    assert out.window == 4 and [(c.request_id, c.num_steps) for c in out.chunks] == [("a", 1), ("b", 4)]
    assert kv.num_allocated_blocks("b") == kv.blocks_for_tokens(10 + 4)  # its passes' slots, up front
    _apply(s, out)
    assert "a" not in s.requests and s.requests["b"].num_computed_tokens == 14


def test_a_windows_pass_shapes_are_made_when_indexed_and_are_each_chunk_j_positions_on() -> None:
    sched = SchedulerOutput(
        chunks=[
            ScheduledChunk("a", [1], 40, [], True, SamplingParams(), 1, (), num_steps=4),
            ScheduledChunk("b", [2], 9, [], True, SamplingParams(), 1, (), num_steps=2),
        ],
        window=4,
    )
    passes = window_shapes(sched)
    assert window_shapes(sched) is passes and len(passes) == 4 and passes.rows == [(40, 1, 4), (9, 1, 2)]
    assert passes._made == [None] * 4  # nothing made until asked for
    assert passes[1] == (ChunkShape(41, 1), ChunkShape(10, 1))
    assert passes._made[0] is None and passes._made[2] is None
    assert list(passes) == [
        (ChunkShape(40, 1), ChunkShape(9, 1)),
        (ChunkShape(41, 1), ChunkShape(10, 1)),
        (ChunkShape(42, 1),),
        (ChunkShape(43, 1),),
    ]
    assert passes[-1] == passes[3] and passes[1:3] == [passes[1], passes[2]]


def test_a_windows_tokens_applied_at_once_stop_where_each_token_in_turn_would() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        max_tokens = rng.choice([None, rng.randint(1, 12)])
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, 6 if max_tokens is None else min(6, max_tokens)),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.sample(range(5), rng.randint(0, 2)),
        )
        prompt = list(range(10, 10 + rng.randint(1, 6)))
        done = [rng.randrange(6) for _ in range(rng.randint(0, 4))]
        max_model_len = len(prompt) + rng.randint(len(done) + 1, 16)
        window = [rng.randrange(6) for _ in range(rng.randint(1, 8))]
        one, each = (_decoding(prompt, params, max_model_len, done) for _ in range(2))
        kept, status = one.append_outputs(window)
        each_kept, each_status = 0, None
        for token in window:
            each.append_output(token)
            each_kept += 1
            each_status = each.check_stop()
            if each_status is not None:
                break
        assert (kept, status, one.stop_reason) == (each_kept, each_status, each.stop_reason)
        assert one.output_token_ids == each.output_token_ids and one.all_token_ids == each.all_token_ids


def _decoding(prompt: list[int], params: SamplingParams, max_model_len: int, done: list[int]) -> Request:
    request = Request("r", prompt, params, 0.0, eos_token_ids=(0, 1), max_model_len=max_model_len)
    for token in done:
        request.append_output(token)
    return request


def _apply(s: Scheduler, out: SchedulerOutput) -> None:
    s.advance(out, 0.01)
    for c in out.chunks:
        for _ in range(c.num_steps):
            s.requests[c.request_id].append_output(7)
        if s.requests[c.request_id].check_stop() is not None:
            s.finish(c.request_id, RequestStatus.FINISHED_LENGTH)


def test_a_window_needing_more_blocks_than_are_free_is_an_ordinary_step() -> None:
    kv = KVCacheManager(2, 4, True, "fp")  # 8 slots
    s = Scheduler(kv, FCFSPolicy(), lambda: 0.0, max_num_batched_tokens=32, max_num_seqs=8, num_scheduler_steps=8)
    s.add(Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8), arrival_time=0.0))
    _apply(s, s.schedule())
    out = s.schedule()  # 7 tokens, 6 with KV: a window of 7 passes needs 13 slots, there are 8
    assert out.window == 1


def test_the_serving_loop_with_swaps_gives_the_same_tokens(tiny_llama: LoadedModel) -> None:
    """Through the server's engine loop (a background thread), with swaps to host memory in the windows' steps."""
    prompts = {str(i): [(7 * i + j) % 300 + 3 for j in range(40)] for i in range(4)}
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    runs = {}
    for k in (1, 4):
        config = EngineConfig(
            model=ModelConfig(max_model_len=128),
            cache=CacheConfig(num_kv_blocks=8, swap_space_gb=0.001),
            scheduler=SchedulerConfig(policy="fcfs", num_scheduler_steps=k),
        )
        core = EngineCore.from_model(tiny_llama, config)
        tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        finished: set[str] = set()
        done = threading.Event()

        def sink(delta: RequestDelta, tokens=tokens, finished=finished, done=done) -> None:
            tokens[delta.request_id] += delta.new_token_ids
            if delta.finished:
                finished.add(delta.request_id)
                if len(finished) == len(prompts):
                    done.set()

        loop = EngineLoop(core, sink)
        try:
            for rid, prompt in prompts.items():
                loop.add(rid, prompt, params)
            assert done.wait(timeout=300), "every request ends"
        finally:
            loop.shutdown()
        assert core.stats().num_swapped_out > 0, "the workload swaps"
        runs[k] = tokens
    assert runs[4] == runs[1]
    assert all(len(t) == 30 for t in runs[4].values())


def test_a_window_of_no_steps_is_a_start_up_error() -> None:
    with pytest.raises(ConfigError, match="--num-scheduler-steps"):
        SchedulerConfig(num_scheduler_steps=0)
