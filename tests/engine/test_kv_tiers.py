"""The engine with KV below the device: prefixes load from the disk store ahead of their turn and in the
background, a request waiting for its loads holds nobody up, and one whose prefix came from disk produces
the tokens of a cold one.

The disk store is conftest's ``DictStore`` (wrapped in its ``GatedStore`` where a test needs a slow disk)
until the persistent store (``kv/disk_store.py``) lands; it plugs in behind the same interface.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.builder import ModelIdentity, build_model_executor, size_engine
from boundless.engine.core import EngineCore
from boundless.engine.request import Request, RequestStatus
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import Scheduler, SchedulerOutput
from boundless.kv.disk_moves import DiskReadDone, DiskWrite, DiskWriteDone, TierReport
from boundless.kv.manager import KVCacheManager
from boundless.kv.remote_moves import RemoteRecv, RemoteReport
from boundless.kv.tensors import PagedKVCache
from boundless.kv.transfer import DISK, HOST
from boundless.model.loader import LoadedModel
from boundless.programs.policy import FCFSPolicy

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _scheduler(max_num_seqs: int = 4) -> Scheduler:
    kv = KVCacheManager(64, 4, True, "fp", num_host_blocks=32, disk=True, write_policy="off")
    return Scheduler(kv, FCFSPolicy(), lambda: 0.0, max_num_batched_tokens=64, max_num_seqs=max_num_seqs)


def _on_disk(s: Scheduler, rid: str, tokens: list[int]) -> None:
    """Make the manager know the store holds these tokens' blocks (as a finished write would)."""
    keys = tuple(s.kv.block_hashes(f"{rid}-written", tokens))
    s.kv.finish_disk_writes([DiskWriteDone(written=keys)])


def _admit_cold(s: Scheduler, request: Request) -> None:
    """Add a request the store knows nothing of: its probe finds nothing, and it is admitted the step after."""
    s.add(request)
    (probe,) = s.schedule().disk_reads
    assert probe.is_probe and request.status is RequestStatus.WAITING
    s.apply_tier_report(TierReport(reads=(DiskReadDone(probe.read_id, 0, 0.0),)))
    out = s.schedule()
    assert request.request_id in [c.request_id for c in out.chunks]
    s.advance(out, 0.01)


def test_a_prefix_on_disk_starts_loading_when_its_call_arrives_not_when_it_is_admitted() -> None:
    s = _scheduler(max_num_seqs=1)
    _admit_cold(s, Request("busy", list(range(500, 520)), SamplingParams(max_tokens=50), arrival_time=0.0))
    prompt = list(range(40))
    _on_disk(s, "next", prompt)
    s.add(Request("next", prompt, SamplingParams(max_tokens=5), arrival_time=1.0))
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["busy"]  # the only slot is taken
    (read,) = out.disk_reads  # yet its blocks are on their way
    assert not read.is_probe and len(read.keys) == 9 and out.num_reads_in_flight == 1


def test_a_request_waiting_for_its_loads_holds_nobody_up() -> None:
    s = _scheduler()
    prompt = list(range(40))
    _on_disk(s, "first", prompt)
    s.add(Request("first", prompt, SamplingParams(max_tokens=5), arrival_time=0.0))  # first in fcfs order
    s.add(Request("second", [100, 101, 102], SamplingParams(max_tokens=5), arrival_time=1.0))  # no full block
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["second"] and len(out.disk_reads) == 1
    assert s.requests["first"].status is RequestStatus.WAITING


def _disk_engine(
    loaded: LoadedModel, store, tmp_path: Path, max_num_seqs: int = 256, write_policy: str = "through"
) -> EngineCore:
    arch = loaded.arch
    per_block = PagedKVCache.bytes_per_block(arch.num_layers, arch.num_kv_heads, arch.head_dim, 16, loaded.dtype)
    config = EngineConfig(
        model=ModelConfig(max_model_len=256),
        cache=CacheConfig(
            num_kv_blocks=32,
            kv_host_gb=64.5 * per_block / (1 << 30),  # 64 blocks: the default GiB takes long to allocate
            kv_disk_path=str(tmp_path),
            kv_write_policy=write_policy,
        ),
        scheduler=SchedulerConfig(policy="fcfs", max_num_seqs=max_num_seqs),
    )
    layout = size_engine(config, loaded.arch, loaded.dtype)
    executor = build_model_executor(loaded, config, layout, store=store)
    return EngineCore(config, layout, ModelIdentity.of(loaded, layout), loaded.tokenizer, executor)


def _tokens(core: EngineCore, request_id: str, outputs: dict[str, list[int]]) -> list[int]:
    while request_id in core.scheduler.requests:
        for delta in core.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return outputs[request_id]


def test_a_prefix_from_disk_gives_the_tokens_of_a_cold_run_and_its_load_holds_nobody_up(
    tiny_llama: LoadedModel, dict_store: type, gated_store: type, tmp_path: Path
) -> None:
    base = dict_store()
    store = gated_store(base)
    store.release.set()
    core = _disk_engine(tiny_llama, store, tmp_path)
    prompt = [(13 * j) % 300 + 3 for j in range(70)]
    outputs: dict[str, list[int]] = {}
    core.add_request("cold", prompt, PARAMS)
    cold = _tokens(core, "cold", outputs)
    core.executor.kv_io.flush()
    assert len(base.blocks) >= 4  # write-through: the prompt's full blocks are in the store
    core.reset_prefix_cache()  # nothing of it left in memory: only the store has it
    store.release.clear()  # and the store is slow
    core.add_request("again", prompt, PARAMS)
    core.add_request("other", [5, 6, 7, 8, 9], PARAMS)
    _tokens(core, "other", outputs)  # served while "again" waits for its blocks
    assert "again" not in outputs and core.kv.is_loading("again")
    store.release.set()
    assert _tokens(core, "again", outputs) == cold
    stats = core.stats()
    assert core.scheduler.requests == {} and stats.kv_tiers[DISK].hit_tokens >= 64
    assert stats.disk_io is not None and stats.disk_io.blocks_loaded >= 4


def test_a_call_whose_context_is_in_memory_does_not_wait_to_probe_its_new_input() -> None:
    s = _scheduler()
    context = list(range(40))
    _admit_cold(s, Request("call-1", context, SamplingParams(max_tokens=1), arrival_time=0.0))
    s.finish("call-1", RequestStatus.FINISHED_LENGTH)  # its blocks stay cached on the device
    # The next call extends the context with new input: unknown to the store, probed, but not waited for.
    s.add(Request("call-2", [*context, *range(500, 520)], SamplingParams(max_tokens=1), arrival_time=1.0))
    out = s.schedule()
    (probe,) = out.disk_reads
    assert probe.is_probe and [c.request_id for c in out.chunks] == ["call-2"]
    assert out.chunks[0].start_pos == 40  # its context came from the device


def test_a_load_past_its_timeout_is_given_up_and_no_new_load_queues_behind_it() -> None:
    now = [0.0]
    kv = KVCacheManager(64, 4, True, "fp", num_host_blocks=32, disk=True, write_policy="off", load_timeout_s=5.0)
    s = Scheduler(kv, FCFSPolicy(), lambda: now[0], max_num_batched_tokens=64, max_num_seqs=4)
    prompt, other = list(range(40)), list(range(100, 140))
    _on_disk(s, "stuck", prompt)
    _on_disk(s, "other", other)
    s.add(Request("stuck", prompt, SamplingParams(max_tokens=5), arrival_time=0.0))
    (load,) = s.schedule().disk_reads  # the store never answers it
    now[0] = 4.9
    assert s.schedule().chunks == [] and kv.is_loading("stuck")
    now[0] = 5.0
    out = s.schedule()
    assert [(c.request_id, c.start_pos) for c in out.chunks] == [("stuck", 0)]  # admitted, computes all
    assert kv.counters[DISK].load_timeouts == 1 and kv.disk_stalled
    s.advance(out, 0.01)
    # While the stuck read lasts, a request whose blocks are on disk does not queue a read behind it.
    s.add(Request("other", other, SamplingParams(max_tokens=5), arrival_time=6.0))
    out = s.schedule()
    assert out.disk_reads == [] and ("other", 0) in [(c.request_id, c.start_pos) for c in out.chunks]
    s.advance(out, 0.01)
    # The read ends at last: its blocks become cache in host memory, and reads start again.
    s.apply_tier_report(TierReport(reads=(DiskReadDone(load.read_id, len(load.keys), 30.0),)))
    assert not kv.disk_stalled and kv.counters[DISK].load_timeouts == 1
    s.add(Request("later", [*range(200, 240)], SamplingParams(max_tokens=5), arrival_time=40.0))
    assert [r.is_probe for r in s.schedule().disk_reads] == [True]


def test_a_stopped_engine_has_handed_every_full_block_to_the_store(tiny_llama: LoadedModel, tmp_path: Path) -> None:
    from boundless.kv.disk_store import DiskKVStore, StoreLayout

    store = DiskKVStore(tmp_path, StoreLayout.of_model(tiny_llama, 16, tiny_llama.fingerprint), 1 << 30)
    core = _disk_engine(tiny_llama, store, tmp_path)
    core.add_request("r", list(range(3, 62)), PARAMS)  # 59 + 6 tokens: the last step fills the fourth block
    _tokens(core, "r", {})
    core.close()  # the last step's block was named after the writes were handed over: close hands it over too
    assert store.stats().blocks_held == 4


def test_a_stopped_engine_under_write_back_hands_the_blocks_in_memory_to_the_store(
    tiny_llama: LoadedModel, tmp_path: Path
) -> None:
    """``--kv-write-policy back`` writes a block when it leaves host memory, which a stopping engine's blocks never
    do: a restart found an empty store. Now a stop hands every named block in memory to the store, and a restarted
    engine loads the prefix it computed."""
    from boundless.kv.disk_store import DiskKVStore, StoreLayout

    layout = StoreLayout.of_model(tiny_llama, 16, tiny_llama.fingerprint)
    prompt = list(range(3, 62))  # 59 + 6 tokens: four full blocks
    before = _disk_engine(tiny_llama, DiskKVStore(tmp_path, layout, 1 << 30), tmp_path, write_policy="back")
    outputs: dict[str, list[int]] = {}
    before.add_request("a", prompt, PARAMS)
    _tokens(before, "a", outputs)
    disk_io = before.stats().disk_io
    assert disk_io is not None and disk_io.blocks_written == 0  # (write-back: nothing left memory)
    before.close()
    store = DiskKVStore(tmp_path, layout, 1 << 30)
    assert store.stats().blocks_held == 4
    after = _disk_engine(tiny_llama, store, tmp_path, write_policy="back")
    after.add_request("a2", prompt, PARAMS)
    assert _tokens(after, "a2", outputs) == outputs["a"]
    assert after.stats().kv_tiers[DISK].hit_tokens == 3 * 16  # (the last block's token is the prompt's end: computed)
    after.close()


@pytest.mark.parametrize("lost", [False, True])
def test_a_close_whose_last_step_fails_still_lets_the_executor_go(
    tiny_llama: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lost: bool
) -> None:
    """The step that hands write-back's blocks to the store failing (a split model's rank gone) skipped the executor's
    close: its ranks, threads and store were never let go. A lost engine runs no such step at all."""
    from boundless.kv.disk_store import DiskKVStore, StoreLayout

    store = DiskKVStore(tmp_path, StoreLayout.of_model(tiny_llama, 16, tiny_llama.fingerprint), 1 << 30)
    core = _disk_engine(tiny_llama, store, tmp_path, write_policy="back")
    core.add_request("a", list(range(3, 62)), PARAMS)
    _tokens(core, "a", {})
    steps, closed = [], []

    def failing_step() -> list:
        steps.append(1)
        raise RuntimeError("rank 1 is gone (the test's)")

    close = core.executor.close

    def counted_close() -> None:
        closed.append(1)
        close()

    monkeypatch.setattr(core, "step", failing_step)
    monkeypatch.setattr(core.executor, "close", counted_close)
    core.close(lost=lost)
    assert closed == [1] and steps == ([] if lost else [1])


def test_a_restarted_engine_loads_what_an_earlier_one_wrote_even_behind_a_prefix_in_memory(
    tiny_llama: LoadedModel, tmp_path: Path
) -> None:
    from boundless.kv.disk_store import DiskKVStore, StoreLayout

    layout = StoreLayout.of_model(tiny_llama, 16, tiny_llama.fingerprint)
    shared = [(5 * j) % 300 + 3 for j in range(48)]  # three blocks every conversation starts with
    first, second = shared + list(range(100, 141)), shared + list(range(200, 241))
    before = _disk_engine(tiny_llama, DiskKVStore(tmp_path, layout, 1 << 30), tmp_path)
    outputs: dict[str, list[int]] = {}
    for rid, prompt in (("a", first), ("b", second)):
        before.add_request(rid, prompt, PARAMS)
        _tokens(before, rid, outputs)
    before.close()
    after = _disk_engine(tiny_llama, DiskKVStore(tmp_path, layout, 1 << 30), tmp_path)  # nothing in memory
    for rid, prompt in (("a2", first), ("b2", second)):
        after.add_request(rid, prompt, PARAMS)
        assert _tokens(after, rid, outputs) == outputs[rid[0]]
    # The second conversation's own blocks follow the shared ones, in memory since the first: they are loaded
    # too, since the store said at start what it held (an unknown block there would have been computed).
    assert after.stats().kv_tiers[DISK].hit_tokens == 5 * 16 + 2 * 16


def test_blocks_gone_from_the_store_after_the_first_a_read_lacks_are_written_again(
    tiny_llama: LoadedModel, tmp_path: Path
) -> None:
    """Two block files deleted while an engine serves (it knew them from its start): its read stops at the first, and
    both are computed and written again, so the store holds the whole prompt again. (The manager forgot only the
    first block a read lacked: the second, still "known", was never written again, and every later start missed from
    there.)"""
    from boundless.kv.block_hash import extend_block_hashes
    from boundless.kv.disk_store import DiskKVStore, StoreLayout

    layout = StoreLayout.of_model(tiny_llama, 16, tiny_llama.fingerprint)
    prompt = list(range(3, 62))  # 59 + 6 tokens: four full blocks
    first = _disk_engine(tiny_llama, DiskKVStore(tmp_path, layout, 1 << 30), tmp_path)
    outputs: dict[str, list[int]] = {}
    first.add_request("a", prompt, PARAMS)
    _tokens(first, "a", outputs)
    first.close()
    store = DiskKVStore(tmp_path, layout, 1 << 30)
    second = _disk_engine(tiny_llama, store, tmp_path)  # knows the four blocks from its start
    keys = extend_block_hashes([], prompt, 16, tiny_llama.fingerprint)
    for key in keys[1:3]:
        (path,) = tmp_path.rglob(key.hex() + ".kv")
        path.unlink()
    second.add_request("b", prompt, PARAMS)
    assert _tokens(second, "b", outputs) == outputs["a"]
    second.close()
    assert all(store.contains(key) for key in keys[:4])


def test_a_colocated_engine_loads_blocks_another_engine_wrote_behind_its_prefix_in_memory(
    tiny_llama: LoadedModel, tmp_path: Path
) -> None:
    from boundless.kv.disk_store import DiskKVStore, StoreLayout

    layout = StoreLayout.of_model(tiny_llama, 16, tiny_llama.fingerprint)
    shared = [(5 * j) % 300 + 3 for j in range(48)]  # three blocks
    longer = shared + list(range(100, 141))  # five full blocks
    core = _disk_engine(tiny_llama, DiskKVStore(tmp_path, layout, 1 << 30), tmp_path)  # started on an empty store
    outputs: dict[str, list[int]] = {}
    core.add_request("a", [*shared, 7], PARAMS)
    _tokens(core, "a", outputs)  # the shared blocks stay in its memory
    other = _disk_engine(tiny_llama, DiskKVStore(tmp_path, layout, 1 << 30), tmp_path)
    other.add_request("w", longer, PARAMS)
    _tokens(other, "w", outputs)
    other.close()  # another engine wrote blocks 3 and 4, which this one never heard of
    core.add_request("b", longer, PARAMS)
    assert _tokens(core, "b", outputs) == outputs["w"]
    # Counted on arrival (a stat each), so loaded, not probed behind its prefix in memory and computed meanwhile.
    stats = core.stats()
    assert stats.kv_tiers[DISK].hit_tokens == 2 * 16 and core.kv.counters[DISK].recomputed_blocks == {}


def test_a_prefix_in_memory_at_arrival_evicted_before_admission_and_computed_is_counted(
    tiny_llama: LoadedModel, dict_store: type, tmp_path: Path
) -> None:
    # One seat: a call waits while another runs, as a PE's calls wait behind each other's prefills.
    core = _disk_engine(tiny_llama, dict_store(), tmp_path, max_num_seqs=1)
    context = [(13 * j) % 300 + 3 for j in range(70)]  # four full blocks
    outputs: dict[str, list[int]] = {}
    core.add_request("first", context, PARAMS)
    cold = _tokens(core, "first", outputs)
    core.executor.kv_io.flush()  # written through: the store holds the four blocks too
    core.add_request("busy", [5, 6, 7, 8, 9], PARAMS)
    core.step()
    core.add_request("next", context, PARAMS)  # its whole context in memory at its arrival: nothing to read
    core.step()
    assert core.scheduler.requests["next"].status is RequestStatus.WAITING
    _evict_from_memory(core.kv)  # other calls' admissions and loads take the memory before its turn
    assert core.kv.memory_prefix(None, context, 4) == []
    assert _tokens(core, "next", outputs) == cold  # computed again, with the same tokens
    assert core.stats().kv_tiers[DISK].recomputed_blocks == {"evicted_before_admission": 4}


def _three_on_disk(s: Scheduler) -> dict[str, list[int]]:
    """Three calls of 40 tokens (9 loadable blocks each) whose blocks the store holds, added in this order: host
    memory's prefetch share (16 of 32 blocks) loads a's 9 and 7 of b's, and has no room for c's."""
    prompts = {rid: list(range(100 * i, 100 * i + 40)) for i, rid in enumerate("abc")}
    for rid, prompt in prompts.items():
        _on_disk(s, rid, prompt)
        s.add(Request(rid, prompt, SamplingParams(max_tokens=1), arrival_time=float(len(s.requests))))
    return prompts


def test_a_call_whose_stored_prefix_finds_no_host_room_waits_for_the_loads_ahead_instead_of_computing_it() -> None:
    s = _scheduler()
    _three_on_disk(s)
    out = s.schedule()
    assert [len(r.keys) for r in out.disk_reads] == [9, 7] and out.chunks == []  # c waits for room, not computes
    assert s.kv.waits_for_host_room("c")
    s.apply_tier_report(TierReport(reads=tuple(DiskReadDone(r.read_id, len(r.keys), 0.1) for r in out.disk_reads)))
    starts: dict[str, int] = {}
    for _ in range(6):  # a and b are admitted with their loads, which frees the share for c's
        out = s.schedule()
        starts |= {c.request_id: c.start_pos for c in out.chunks if c.request_id not in starts}
        s.apply_tier_report(TierReport(reads=tuple(DiskReadDone(r.read_id, len(r.keys), 0.1) for r in out.disk_reads)))
        s.advance(out, 0.01)
    assert starts["a"] == 36 and starts["c"] == 36  # c read its 9 stored blocks
    assert s.kv.counters[DISK].recomputed_blocks == {}


def test_without_waiting_for_host_room_the_stored_blocks_a_call_computes_are_counted() -> None:
    s = _scheduler()
    s.wait_for_host_room = False  # the earlier rule
    _three_on_disk(s)
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["c"] and out.chunks[0].start_pos == 0  # computes its prefix
    assert s.kv.counters[DISK].recomputed_blocks == {"no_host_room": 9}


def _prefix_on_device_rest_on_disk() -> tuple[KVCacheManager, list[int], list[int]]:
    """A manager (16 device blocks, 20 host: a prefetch share of 10) whose device caches the first 3 blocks of a
    40-token prompt (an earlier call's) and whose store holds all of them. Returns it, the prompt and the device
    blocks' ids."""
    kv = KVCacheManager(16, 4, True, "fp", num_host_blocks=20, disk=True, write_policy="off")
    prompt = list(range(40))
    kv.allocate("earlier", prompt[:12], 12)
    device = [b.block_id for b in kv._tables["earlier"]]
    kv.free("earlier")
    kv.finish_disk_writes([DiskWriteDone(written=tuple(kv.block_hashes("written", prompt)))])
    return kv, prompt, device


def _evict_from_memory(kv: KVCacheManager) -> None:
    """Other work takes every free device block, then every free host block (where the device's went)."""
    taken = kv.allocate_unowned(kv.pool.num_free)
    kv.begin_step()  # the step's copies down to host memory are done
    host = kv.pools[HOST]
    host.free(host.allocate(host.num_free))
    kv.free_unowned(taken or [])


def test_a_waiting_calls_prefix_in_memory_stays_there_while_its_load_runs() -> None:
    kv, prompt, device = _prefix_on_device_rest_on_disk()
    read = kv.plan_disk_read("w", prompt)
    assert read is not None and len(read.keys) == 6  # blocks 3..8: the first 3 are on the device
    assert [kv.pool.blocks[b].ref_count for b in device] == [1, 1, 1]  # held for it until its turn
    _evict_from_memory(kv)
    kv.finish_disk_reads([DiskReadDone(read.read_id, 6, 0.1)])
    assert kv.plan_disk_read("w", prompt) is None  # nothing to read again
    assert kv.find_cached_prefix("w", prompt).num_tokens == 36
    assert kv.counters[DISK].reloaded_blocks == 0 and kv.counters[DISK].recomputed_blocks == {}
    assert kv.allocate("w", prompt, 40, kv.find_cached_prefix("w", prompt))
    kv.free("w")  # admitted and done: the hold went with its admission, so nothing is held now
    assert kv.pool.num_free == kv.pool.num_blocks


def test_a_prefix_that_left_memory_before_its_turn_is_read_again_gap_only_and_counted_apart(monkeypatch) -> None:
    import boundless.kv.manager as manager

    monkeypatch.setattr(manager, "LOAD_HOLD_SHARE", 0.0)  # no device blocks may be held: the prefix can leave
    kv, prompt, device = _prefix_on_device_rest_on_disk()
    read = kv.plan_disk_read("w", prompt)
    assert read is not None and len(read.keys) == 6
    assert [kv.pool.blocks[b].ref_count for b in device] == [0, 0, 0]
    _evict_from_memory(kv)
    kv.finish_disk_reads([DiskReadDone(read.read_id, 6, 0.1)])
    again = kv.plan_disk_read("w", prompt)
    # Only the 3 blocks that left are read again, not the 6 still in host memory for it.
    assert again is not None and again.keys == tuple(kv.block_hashes("w", prompt)[:3])
    assert kv.counters[DISK].reloaded_blocks == 3 and kv.counters[DISK].recomputed_blocks == {}
    kv.finish_disk_reads([DiskReadDone(again.read_id, 3, 0.1)])
    assert kv.plan_disk_read("w", prompt) is None
    assert kv.find_cached_prefix("w", prompt).num_tokens == 36  # read, not computed


def test_a_push_load_goes_on_in_chunks_until_done_and_gives_up_only_when_no_read_can_give_room_back() -> None:
    kv = KVCacheManager(64, 4, True, "fp", num_host_blocks=16, disk=True, write_policy="off")  # 8 blocks of prefetch
    other = list(range(1000, 1017))  # another call loading four stored blocks: half the prefetch room
    kv.note_on_disk(kv.block_hashes("o", other)[:4])
    loading = kv.plan_disk_read("o", other)
    assert loading is not None and len(loading.keys) == 4
    prompt = list(range(80))
    kv.load_for_push("r", 2, 12)  # a DE-read push of blocks 2..11
    first = kv.plan_disk_read("r", prompt)
    assert first is not None and len(first.keys) == 4  # the room there is
    kv.finish_disk_reads([DiskReadDone(first.read_id, 4, 0.0)])
    # Six blocks still to load: the push waits, and so does the load while the other call's read may give room.
    assert kv.plan_disk_read("r", prompt) is None and kv.has_read_in_flight("r")
    kv.finish_disk_reads([DiskReadDone(loading.read_id, 4, 0.0)])
    kv.free("o")  # the other call left: its loaded blocks give their room back
    second = kv.plan_disk_read("r", prompt)
    assert second is not None and len(second.keys) == 4 and kv.has_read_in_flight("r")
    kv.finish_disk_reads([DiskReadDone(second.read_id, 4, 0.0)])
    # Eight loaded blocks fill the prefetch share and no read is in flight to give room back: the rest is given
    # up, and the push goes with what it has (the prefill engine reads or computes the rest).
    assert kv.plan_disk_read("r", prompt) is None and not kv.has_read_in_flight("r")
    assert len(kv.memory_prefix("r", prompt, 12, first=2)) == 8


def _stored_then_forgotten(core: EngineCore, prompt: list[int]) -> list[int]:
    """Serve ``prompt`` once (write-through puts its full blocks in the store), then forget it in memory: only the
    store has its KV. Returns the tokens it gave."""
    outputs: dict[str, list[int]] = {}
    core.add_request("cold", prompt, PARAMS)
    cold = _tokens(core, "cold", outputs)
    core.executor.kv_io.flush()
    core.reset_prefix_cache()
    return cold


def _until(core: EngineCore, done) -> None:
    """Step an engine with no request (its reads ahead only) until ``done()``, bounded."""
    import time

    for _ in range(2000):
        if done():
            return
        core.step()
        time.sleep(0.005)
    raise AssertionError("the engine's reads never landed")


def test_a_context_read_ahead_for_a_call_not_here_yet_is_what_the_call_uses_and_not_read_again(
    tiny_llama: LoadedModel, dict_store: type, tmp_path: Path
) -> None:
    store = dict_store()
    core = _disk_engine(tiny_llama, store, tmp_path)
    prompt = [(13 * j) % 300 + 3 for j in range(70)]
    cold = _stored_then_forgotten(core, prompt)
    loaded_before = core.stats().disk_io.blocks_loaded
    # The dispatcher reads the call's stored context into this engine's host memory while the call waits elsewhere.
    assert core.prefetch("call", prompt) == 4 and core.has_work()
    _until(core, lambda: core.kv.num_reads_in_flight == 0 and len(core.kv.memory_prefix(None, prompt, 4)) == 4)
    assert core.stats().disk_io.blocks_loaded == loaded_before + 4
    # It is held for the call: other work taking every free block of memory leaves it there.
    _evict_from_memory(core.kv)
    assert len(core.kv.memory_prefix(None, prompt, 4)) == 4
    # The call comes: it finds its context in host memory, reads nothing, and gives the tokens of a cold run.
    outputs: dict[str, list[int]] = {}
    core.add_request("call", prompt, PARAMS)
    assert _tokens(core, "call", outputs) == cold
    stats = core.stats()
    assert stats.disk_io.blocks_loaded == loaded_before + 4  # not read a second time
    assert stats.kv_tiers[DISK].hit_tokens == 64 and stats.kv_tiers[DISK].reloaded_blocks == 0
    assert stats.kv_tiers[DISK].recomputed_blocks == {} and not core.has_work()
    assert core.kv.pools[HOST].num_used == 0  # admitted: the hold went with it


def test_a_read_ahead_for_a_call_that_comes_with_a_cache_salt_is_not_its_and_names_nothing_of_it(
    tiny_llama: LoadedModel, dict_store: type, tmp_path: Path
) -> None:
    """The dispatcher reads ahead knowing only the prompt: under the model's names. A call that comes with a
    ``cache_salt`` (or a LoRA adapter) names its KV under another fingerprint: it reuses nothing read ahead, and its
    own blocks are named under its salt, not the model's (the names kept for the read were the request id's)."""
    core = _disk_engine(tiny_llama, dict_store(), tmp_path)
    prompt = [(17 * j) % 300 + 3 for j in range(70)]
    cold = _stored_then_forgotten(core, prompt)
    assert core.prefetch("call", prompt) == 4
    _until(core, lambda: core.kv.num_reads_in_flight == 0 and len(core.kv.memory_prefix(None, prompt, 4)) == 4)
    salted = dataclasses.replace(PARAMS, cache_salt="tenant-a")
    core.add_request("call", prompt, salted)
    assert _tokens(core, "call", {}) == cold
    assert core.memory_prefix_blocks(prompt, salted) == 4  # its own blocks, under its salt
    assert core.stats().kv_tiers[DISK].hit_tokens == 0  # nothing of the model's read ahead was its
    assert core.kv.pools[HOST].num_used == 0 and not core.has_work()  # the read ahead is cache, held by nothing


def test_a_read_ahead_whose_call_is_dropped_or_never_comes_leaves_only_cache(
    tiny_llama: LoadedModel, dict_store: type, gated_store: type, tmp_path: Path
) -> None:
    import boundless.engine.core as core_module

    base = dict_store()
    store = gated_store(base)
    store.release.set()
    core = _disk_engine(tiny_llama, store, tmp_path)
    prompt = [(7 * j) % 300 + 3 for j in range(70)]
    _stored_then_forgotten(core, prompt)
    host = core.kv.pools[HOST]
    # Dropped while its read is in flight (a slow store): the read lands as cache for nobody.
    store.release.clear()
    assert core.prefetch("aborted", prompt) == 4
    core.step()
    assert core.kv.num_reads_in_flight == 1
    core.drop_prefetch("aborted")
    store.release.set()
    _until(core, lambda: core.kv.num_reads_in_flight == 0 and len(core.kv.memory_prefix(None, prompt, 4)) == 4)
    assert host.num_used == 0 and not core.has_work()  # cached, held by nothing: evictable
    # Never claimed: after PREFETCH_HOLD_S the engine lets it go by itself.
    core.reset_prefix_cache()
    assert core.prefetch("lost", prompt) == 4
    _until(core, lambda: core.kv.num_reads_in_flight == 0 and len(core.kv.memory_prefix(None, prompt, 4)) == 4)
    assert host.num_used == 4
    start = core.clock()
    core.clock = lambda: start + core_module.PREFETCH_HOLD_S + 1
    core.step()
    assert host.num_used == 0 and not core.has_work()


def test_reads_ahead_go_in_chunks_few_at_a_time_so_a_placed_calls_read_waits_behind_little() -> None:
    import boundless.kv.manager as manager

    kv = KVCacheManager(16, 4, True, "fp", num_host_blocks=100, disk=True, write_policy="off")
    prompts = {f"c{i}": list(range(100 * i, 100 * i + 60)) for i in range(3)}  # 14 loadable blocks each
    for prompt in prompts.values():
        kv.finish_disk_writes([DiskWriteDone(written=tuple(kv.block_hashes("written", prompt)))])
    for rid, prompt in prompts.items():
        assert kv.prefetch(rid, prompt, lambda keys: len(keys)) == 14
    reads = kv.plan_prefetch_reads()
    assert len(reads) == manager.PREFETCH_READS_IN_FLIGHT == 2
    assert [len(r.keys) for r in reads] == [manager.PREFETCH_READ_BLOCKS] * 2
    assert all(r.ahead for r in reads)  # the loader runs them after the reads of requests here
    assert kv.plan_prefetch_reads() == []  # none more while those are in flight
    kv.finish_disk_reads([DiskReadDone(reads[0].read_id, 8, 0.1)])
    (read,) = kv.plan_prefetch_reads()  # the first call's last 6 blocks
    assert len(read.keys) == 6 and read.keys[0] == kv.block_hashes("c0", prompts["c0"])[8]


def test_a_swap_out_short_of_host_room_takes_the_room_of_reads_ahead_first() -> None:
    kv = KVCacheManager(16, 4, True, "fp", num_host_blocks=20, disk=True, write_policy="off")
    prompt = list(range(40))
    kv.finish_disk_writes([DiskWriteDone(written=tuple(kv.block_hashes("written", prompt)))])
    assert kv.prefetch("later", prompt, lambda keys: len(keys)) == 9
    (read,) = kv.plan_prefetch_reads()  # in chunks: 8 blocks, then the last
    kv.finish_disk_reads([DiskReadDone(read.read_id, 8, 0.1)])
    (read,) = kv.plan_prefetch_reads()
    kv.finish_disk_reads([DiskReadDone(read.read_id, 1, 0.1)])
    host = kv.pools[HOST]
    assert host.num_used == 9  # held for the call that has not come
    assert kv.allocate("running", list(range(100, 148)), 48)  # 12 device blocks: a swap-out needs 12 host blocks
    assert kv.release_prefetched([]) and host.num_used == 0  # the read ahead gave way (its blocks stay cached)
    assert len(kv.memory_prefix(None, prompt, 9)) == 9


def test_blocks_taken_for_a_debtor_s_loan_drop_their_names_instead_of_copying_them_to_host_memory() -> None:
    """A creditor's blocks lent to a debtor (KV lending) are written at once, between steps: a demotion of their old
    KV to host memory would copy at the next step's start, after the debtor's KV overwrote it, and keep that under
    the old name for a later prefix hit to read (a held-back request recomputed on the creditor produced other
    tokens: tests/engine/test_lending_hold.py)."""
    kv = KVCacheManager(8, 4, True, "fp", num_host_blocks=8)
    prompt = list(range(32))
    kv.allocate("earlier", prompt, 32)
    kv.free("earlier")  # 8 named blocks, free
    assert kv.find_cached_prefix("later", prompt).num_tokens == 28  # all but the last block would be reused
    taken = kv.allocate_unowned(8)
    assert taken is not None and kv.take_transfers() == []  # nothing copied down
    assert kv.find_cached_prefix("later", prompt).num_tokens == 0  # and no name left, here or below
    kv.free_unowned(taken)
    assert kv.pool.num_free == 8 and kv.pools[HOST].num_free == 8
    # A device allocation for a request still demotes what it evicts.
    kv.allocate("again", prompt, 32)
    kv.free("again")
    kv.allocate("other", list(range(100, 132)), 32)
    assert len(kv.take_transfers()) == 8 and kv.find_cached_prefix("later", prompt).num_tokens == 28


def test_a_request_held_back_by_kv_lending_loads_nothing_from_disk_until_released() -> None:
    """The deadlock breaker's hold (``Scheduler.hold``) frees a request's blocks for another's growth: a load of its
    stored prefix would pin its cached blocks on the device for it again, and the other would wait for good."""
    s = _scheduler()
    prompt = list(range(40))  # 10 blocks
    _admit_cold(s, Request("held", prompt, SamplingParams(max_tokens=5), arrival_time=0.0))
    _on_disk(s, "held", prompt)
    assert s.hold("held")
    # Blocks lent to another instance's request take every free block but 5 of its cached ones (its tail goes).
    taken = s.kv.allocate_unowned(s.kv.pool.num_free - 5)
    assert taken is not None and 0 < s.kv.find_cached_prefix("held", prompt).num_tokens < 36
    out = s.schedule()
    assert out.disk_reads == [] and out.chunks == [] and s.kv.pool.num_free == 5  # nothing pinned for it
    s.kv.free_unowned(taken)
    assert s.release("held") and not s.release("held")
    (read,) = s.schedule().disk_reads  # released: its tail loads as any waiting request's
    assert not read.is_probe and len(read.keys) > 0


def test_a_request_awaiting_a_lending_grant_loads_nothing_from_disk_until_granted() -> None:
    """A request longer than the pool waits for the gManager's grant (``cluster/lending_grants.py``) holding
    nothing: a load of its stored prefix would pin device blocks its instance may be lending to a granted request."""
    s = _scheduler()
    s.grants_required = True
    prompt = list(range(260))  # 65 blocks: one more than the pool
    _on_disk(s, "long", prompt)
    s.add(Request("long", prompt, SamplingParams(max_tokens=5), arrival_time=0.0))
    out = s.schedule()
    assert out.disk_reads == [] and out.chunks == [] and s.kv.pool.num_free == 64
    assert s.grant("long")
    (read,) = s.schedule().disk_reads  # granted: its prefix loads as any waiting request's
    assert not read.is_probe and len(read.keys) > 0


class _FastPeer:
    """A peer whose blocks land the moment a receive is posted (the executor's ``RemoteIO``, cut to what a step
    without sends needs): each receive's host blocks are overwritten with 7s at once."""

    def __init__(self, tiers) -> None:
        self.host = tiers[HOST]
        self.gates_for = None

    def start(self, recvs, sends):
        for recv in recvs:
            blocks = self.host.read_blocks(recv.dst_ids)
            self.host.write_blocks(recv.dst_ids, torch.full_like(blocks, 7.0))
        return None

    def recv_gates(self, host_block_ids):
        return {}

    def end_step(self, ok: bool) -> None:
        pass

    def report(self, wait_s: float = 0.0) -> RemoteReport:
        return RemoteReport()


def test_a_write_back_of_a_host_block_a_receive_reuses_stores_its_old_kv(
    tiny_llama: LoadedModel, dict_store: type, tmp_path: Path
) -> None:
    """A receive from a peer (prefill/decode disaggregation) lands in host blocks the manager evicted for it
    (``expect_blocks``); under write-back the evicted block's KV goes to the store in the same step. It is copied
    before the receive is posted: a fast peer's KV landed first and was stored under the evicted block's name."""
    store = dict_store()
    core = _disk_engine(tiny_llama, store, tmp_path)
    executor = core.executor
    executor.connect(_FastPeer)
    host = executor.tiers[HOST]
    old = torch.randn_like(host.read_blocks([3]))
    host.write_blocks([3], old)
    key = b"evicted-block-name"
    sched = SchedulerOutput(
        disk_writes=[DiskWrite(HOST, (3,), (key,))],
        remote_recvs=[RemoteRecv(recv_id=0, peer="prefill", tag=1, dst_ids=(3,), num_blocks=1)],
    )
    executor.execute(sched)
    executor.kv_io.close()  # the writer finishes what it was handed
    torch.testing.assert_close(store.blocks[key], old[:, :, :, 0], rtol=0, atol=0)
    assert torch.all(host.read_blocks([3]) == 7.0)  # and the peer's KV is where it landed
