"""The simulator runs the real engine (EngineCore) on a cost-model executor in virtual time: deterministic,
policy-sensitive, and with the engine's own sizing, finish rules and the benchmark's prompts."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import shlex
import statistics
import time
from pathlib import Path

import pytest

from boundless.api.launch import start_in_thread
from boundless.bench.programs import ProgramRunner
from boundless.bench.workloads import ProgramSpec, WorkloadShape, make_programs
from boundless.cli import main
from boundless.cluster.links import Link
from boundless.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.async_engine import AsyncEngine
from boundless.engine.builder import size_engine
from boundless.engine.core import EngineCore, EngineStats, RequestDelta
from boundless.engine.errors import InvalidRequestError
from boundless.engine.request import Request
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import ScheduledChunk, SchedulerOutput
from boundless.kv.disk_moves import DiskRead, DiskWrite
from boundless.kv.transfer import DEVICE, DISK, HOST, BlockRef, BlockTransfer
from boundless.sim.cost import CostModel
from boundless.sim.engine import SimulatedModel, simulated_engine
from boundless.sim.executor import CostModelExecutor, DiskCost, SimulatedDisk
from boundless.sim.simulator import Simulator, VirtualClock

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_simulate() -> list[str]:
    """The README's ``boundless simulate`` command (memory-bound chat, where the policies differ), as arguments."""
    text = README.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("boundless simulate "))
    return shlex.split(line.split("#")[0])[1:]


@pytest.fixture(scope="module")
def smollm2_sim() -> SimulatedModel:
    """The bundled model as the simulator knows it: no weights."""
    return SimulatedModel.read(ModelConfig())


def _simulate(tmp_path: Path, name: str, *args: str) -> dict:
    """Run ``boundless simulate`` through the command line's entry point; its figures."""
    out = tmp_path / f"{name}.json"
    assert main([*args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_simulate_command_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    command = _readme_simulate()
    assert command[-2:] == ["--bench-seed", "1"]
    first = _simulate(tmp_path, "a", *command)
    again = _simulate(tmp_path, "b", *command, "--jobs", "2")  # the rows in two processes: the same rows, in order
    assert first["rows"] == again["rows"] and len(again["speed"]["row_cpu_s"]) == len(first["rows"]) == 3
    rows = {r["policy"]: r for r in first["rows"]}
    assert all(r["failed_calls"] == 0 for r in rows.values())
    assert rows["plas"]["avg_latency_s"] < rows["fcfs"]["avg_latency_s"] / 1.3  # program-aware pays here
    other_seed = _simulate(tmp_path, "c", *command[:-1], "2")
    assert other_seed["rows"] != first["rows"]


def test_jobs_is_a_count_of_processes_and_longctx_runs_in_one(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--jobs: at least 1"):
        _simulate(tmp_path, "none", "simulate", "--jobs", "0")
    with pytest.raises(SystemExit, match="longctx workload runs its rows in one process"):
        _simulate(tmp_path, "longctx", "simulate", "--workload", "longctx", "--jobs", "2")


def test_calls_the_engine_refuses_are_counted_and_invalidate_the_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A 48-token context: calls that ask for more output than fits are refused, as the real engine refuses them.
    args = ["simulate", "--policies", "fcfs", "--rates", "0.3", "--num-programs", "20", "--num-kv-blocks", "80"]
    result = _simulate(tmp_path, "refused", *args, "--max-model-len", "48")
    assert result["rows"][0]["failed_calls"] > 0 and "these figures are invalid" in capsys.readouterr().out


def _latencies(
    model: SimulatedModel, policy: str, programs: list[ProgramSpec], cache: CacheConfig | None = None
) -> list[float]:
    return _simulated(model, policy, programs, cache)[0]


def _simulated(
    model: SimulatedModel, policy: str, programs: list[ProgramSpec], cache: CacheConfig | None = None
) -> tuple[list[float], EngineStats]:
    # Device only by default (host memory swaps, keeps nothing evicted): the memory-bound case of docs/programs.md.
    cache = cache or CacheConfig(num_kv_blocks=80, swap_space_gb=1.0)
    config = EngineConfig(cache=cache, scheduler=SchedulerConfig(policy=policy, max_num_seqs=16))
    sim = Simulator(config, model)
    results = sim.run(programs)
    assert len(results) == len(programs) and all(r.finish_s >= r.arrival_s for r in results)
    assert sum(r.output_tokens for r in results) == sum(p.output_tokens for p in programs)  # every call ran
    return [r.latency_s for r in results], sim.core.stats()


@pytest.mark.slow  # (5 s; tests/programs checks the policies' order on the real engine in the fast suite)
def test_memory_bound_load_separates_the_policies(smollm2_sim: SimulatedModel) -> None:
    # A small KV pool (as on a GPU, and as in docs/programs.md): under fcfs, long programs' growing contexts
    # hold the memory.
    fcfs_total = plas_total = 0.0
    for seed in range(4):
        programs = make_programs("chat", 60, rate=0.3, seed=seed)
        fcfs, plas = _latencies(smollm2_sim, "fcfs", programs), _latencies(smollm2_sim, "plas", programs)
        fcfs_total += statistics.fmean(fcfs)
        plas_total += statistics.fmean(plas)
        # The mechanism: short programs (one or two calls) no longer wait behind long ones.
        short = [i for i, p in enumerate(programs) if p.num_calls <= 2]
        assert statistics.fmean(plas[i] for i in short) < statistics.fmean(fcfs[i] for i in short) / 1.3
    assert plas_total < fcfs_total / 1.2


def test_blocks_kept_below_the_device_spare_the_re_prefill_of_evicted_conversations(
    smollm2_sim: SimulatedModel,
) -> None:
    # The README's memory-bound chat: what device-only loses is mostly the re-prefill of evicted conversations.
    programs = make_programs("chat", 40, rate=0.3, seed=1)
    device_only = statistics.fmean(_latencies(smollm2_sim, "fcfs", programs))
    host, stats = _simulated(smollm2_sim, "fcfs", programs, CacheConfig(num_kv_blocks=80, kv_host_gb=1.0))
    assert statistics.fmean(host) < device_only / 1.5
    assert stats.kv_tiers[HOST].hit_tokens > stats.kv_tiers[DEVICE].hit_tokens
    # Host memory for ~140 blocks: too small for the conversations, which the disk store then serves.
    small_host = CacheConfig(num_kv_blocks=80, kv_host_gb=0.1)
    with_disk = dataclasses.replace(small_host, kv_disk_path="unused-by-the-simulator", kv_disk_gb=4.0)
    host_only = statistics.fmean(_latencies(smollm2_sim, "plas", programs, small_host))
    disk, stats = _simulated(smollm2_sim, "plas", programs, with_disk)
    assert stats.disk_io is not None and stats.disk_io.blocks_loaded > 0 and stats.kv_tiers[DISK].hit_tokens > 0
    assert statistics.fmean(disk) < host_only


def test_the_disk_store_costs_virtual_time_in_the_background() -> None:
    cost = CostModel(base_s=0.01, per_token_s=0.001, per_seq_s=0.002)
    disk = SimulatedDisk(100, 1_000_000, DiskCost(read_bytes_per_s=1e9, write_bytes_per_s=1e9, latency_s=1e-3), 4)
    clock = VirtualClock()
    executor = CostModelExecutor(cost, 1_000_000, clock=clock, disk=disk)
    keys = tuple(bytes([i]) for i in range(6))
    writes = [DiskWrite(DEVICE, (0, 1, 2), keys[:3]), DiskWrite(DEVICE, (3, 4), keys[3:5])]
    step = SchedulerOutput(chunks=[_chunk("r0", 1)], disk_writes=writes)
    result = executor.execute(step)
    assert result.elapsed_s == pytest.approx(cost.step_time(step))  # the writes do not slow the step
    # The second write is past the writer's queue of 4 blocks; the first is done within the step (4 ms).
    assert [(w.written, w.dropped) for w in result.tier_report.writes] == [((), keys[3:5]), (keys[:3], ())]
    clock.now += result.elapsed_s
    load = DiskRead(7, keys[:4], (0, 1, 2, 3))  # the store has the first three
    result = executor.execute(SchedulerOutput(disk_reads=[load], num_reads_in_flight=1))
    # Nothing else to do: the step lasts until the load is done, 1 ms + 3 MB at 1 GB/s.
    assert result.elapsed_s == pytest.approx(4e-3)
    assert [(r.read_id, r.num_found) for r in result.tier_report.reads] == [(7, 3)]


def test_disks_sharing_a_storage_link_queue_behind_each_other() -> None:
    # Two instances of a node read 3 MB each at the same time over one 1 GB/s link: the second waits for the first.
    link = Link("storage-node0", 1e9)
    cost = DiskCost(read_bytes_per_s=1e9, latency_s=1e-3)
    disks = [SimulatedDisk(100, 1_000_000, cost, 4, read_link=link) for _ in range(2)]
    keys = tuple(bytes([i]) for i in range(3))
    for disk in disks:
        disk.keys.update(dict.fromkeys(keys))
        disk.read(DiskRead(1, keys, (0, 1, 2)), now=0.0)
    assert [d.next_read_done() for d in disks] == pytest.approx([4e-3, 7e-3])  # 1 ms + 3 ms; then 3 ms more
    alone = SimulatedDisk(100, 1_000_000, cost, 4)  # its own bandwidth: no queue behind another instance
    alone.keys.update(dict.fromkeys(keys))
    alone.read(DiskRead(1, keys, (0, 1, 2)), now=0.0)
    assert alone.next_read_done() == pytest.approx(4e-3)


def _chunk(request_id: str, num_tokens: int) -> ScheduledChunk:
    return ScheduledChunk(request_id, [5] * num_tokens, 0, [0], True, SamplingParams(), 0, (0,))


def test_step_time_charges_prefill_by_token_and_swaps_by_bytes() -> None:
    cost = CostModel(base_s=0.01, per_token_s=0.001, per_seq_s=0.002)
    decodes = SchedulerOutput(chunks=[_chunk(f"r{i}", 1) for i in range(4)])
    prefill = SchedulerOutput(chunks=[_chunk("p", 101)] + decodes.chunks[1:])
    assert cost.step_time(decodes) == pytest.approx(0.01 + 4 * 0.002)
    assert cost.step_time(prefill) == pytest.approx(0.01 + 4 * 0.002 + 100 * 0.001)
    executor = CostModelExecutor(cost, bytes_per_block=1_000_000, host_copy_bytes_per_s=1e9)
    moves = [((DEVICE, 1), (HOST, 0)), ((DEVICE, 2), (HOST, 1)), ((HOST, 2), (DEVICE, 3))]
    transfers = [BlockTransfer(BlockRef(*src), BlockRef(*dst)) for src, dst in moves]
    swapping = dataclasses.replace(decodes, transfers=transfers)
    assert executor.execute(swapping).elapsed_s == pytest.approx(cost.step_time(decodes) + 3e-3)  # 3 MB at 1 GB/s
    # Every sampling chunk gets a placeholder that neither is an EOS nor one of its stop tokens.
    chunk = dataclasses.replace(
        decodes.chunks[0], eos_token_ids=(100,), sampling_params=SamplingParams(stop_token_ids=[101])
    )
    assert executor.execute(SchedulerOutput(chunks=[chunk])).sampled["r0"].token_id not in (100, 101)


def _run_all(core: EngineCore) -> dict[str, RequestDelta]:
    last = {}
    while core.has_unfinished():
        last.update({d.request_id: d for d in core.step()})
    return last


@pytest.fixture(scope="module")
def tiny_config(model_dirs: dict[str, Path]) -> EngineConfig:
    return EngineConfig(
        ModelConfig(model=str(model_dirs["tiny-llama"]), max_model_len=64),
        CacheConfig(num_kv_blocks=16),
        SchedulerConfig(policy="fcfs"),
    )


def test_the_simulated_engine_caps_and_finishes_as_the_real_one(tiny_llama, tiny_config: EngineConfig) -> None:
    real = EngineCore.from_model(tiny_llama, tiny_config)
    sim = simulated_engine(tiny_config, SimulatedModel.read(tiny_config.model), CostModel(), VirtualClock())
    assert sim.layout == real.layout and sim.max_model_len == real.max_model_len == 64
    assert sim.identity.eos_token_ids == real.identity.eos_token_ids
    prompt = list(range(10, 50))  # 40 tokens: 24 left in the context
    results = []
    for core in (real, sim):
        with pytest.raises(InvalidRequestError) as refused:  # 40 + 30 > 64
            core.add_request("long", prompt, SamplingParams(max_tokens=30))
        core.add_request("to-the-cap", prompt, SamplingParams(max_tokens=None, ignore_eos=True))
        core.add_request("short", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        ends = _run_all(core)
        results.append((str(refused.value), {rid: (d.finish_reason, d.num_output_tokens) for rid, d in ends.items()}))
    assert results[0] == results[1]
    assert results[1][1] == {"to-the-cap": ("length", 24), "short": ("length", 5)}


def test_an_asked_eos_ends_calls_by_the_engines_rules(tiny_config: EngineConfig) -> None:
    model = SimulatedModel.read(tiny_config.model)
    eos = model.identity.eos_token_ids[0]
    layout = size_engine(tiny_config, model.arch, model.dtype)
    executor = CostModelExecutor(CostModel(), layout.bytes_per_block, token_id=eos)  # asked for an EOS
    sim = EngineCore(tiny_config, layout, model.identity, model.tokenizer, executor, VirtualClock())
    prompt = list(range(10, 20))
    sim.add_request("eos", prompt, SamplingParams(max_tokens=8, min_tokens=3))
    sim.add_request("ignored", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    sim.add_request("stop-id", prompt, SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[eos]))
    ends = _run_all(sim)
    got = {rid: (d.finish_reason, d.stop_reason, d.num_output_tokens) for rid, d in ends.items()}
    assert got == {"eos": ("stop", None, 3), "ignored": ("length", None, 8), "stop-id": ("stop", eos, 1)}


def _recording(core: EngineCore, into: dict[tuple[str, str], list[list[int]]]) -> None:
    """Record every prompt the engine is given, by (program, thread), then add it as usual."""
    add = core.add_request

    def add_and_record(request_id: str, prompt: list[int], params: SamplingParams, **kw: object) -> Request:
        program = kw.get("program")
        into.setdefault((program.program_id, program.thread_id), []).append(list(prompt))  # type: ignore[union-attr]
        return add(request_id, prompt, params, **kw)  # type: ignore[arg-type]

    core.add_request = add_and_record  # type: ignore[method-assign]


def _prompts(model: SimulatedModel, workload: str) -> tuple[dict, dict]:
    """The prompts the benchmark sends for some programs, and those the simulator sends for them."""
    # A context short enough that long conversations are compacted.
    config = EngineConfig(
        ModelConfig(max_model_len=192), CacheConfig(num_kv_blocks=64), SchedulerConfig(max_num_seqs=8)
    )
    programs = make_programs(workload, 8, rate=20.0, seed=3, shape=WorkloadShape(tool_wait_s=0.0))

    # The benchmark's client against a server whose engine runs on the cost-model executor.
    sent: dict[tuple[str, str], list[list[int]]] = {}
    core = simulated_engine(config, model, CostModel(), time.monotonic)
    _recording(core, sent)
    engine = AsyncEngine(core)
    server = start_in_thread(engine, "bench")
    try:
        runner = ProgramRunner(server.url, "bench", core.max_model_len, model.identity.vocab_size)
        asyncio.run(runner.run(programs, "bench"))
    finally:
        server.stop()
        engine.shutdown()

    simulated: dict[tuple[str, str], list[list[int]]] = {}
    sim = Simulator(config, model)
    _recording(sim.core, simulated)
    sim.run(programs)
    return sent, simulated


def test_the_simulator_sends_the_benchmarks_prompts_compacted_alike(smollm2_sim: SimulatedModel) -> None:
    sent, simulated = _prompts(smollm2_sim, "chat")
    assert simulated == sent
    # Compaction happened: some call's prompt is shorter than the conversation it continues.
    assert any(len(b) < len(a) for prompts in sent.values() for a, b in itertools.pairwise(prompts))


def test_the_simulator_joins_threads_as_the_benchmark(smollm2_sim: SimulatedModel) -> None:
    sent, simulated = _prompts(smollm2_sim, "mapreduce")
    assert simulated == sent and any(thread.endswith("reduce") for _, thread in sent)


def test_call_latency_is_reported_per_kind_of_call(smollm2_sim: SimulatedModel) -> None:
    # Map-reduce: maps are a fan-out, reduces join them; chat is a chain. A policy can trade one for another
    # (docs/simulation.md: PLAS delays reduces), so the simulator reports each kind apart.
    config = EngineConfig(cache=CacheConfig(num_kv_blocks=200), scheduler=SchedulerConfig(max_num_seqs=8))
    programs = make_programs("mapreduce", 6, rate=2.0, seed=1, shape=WorkloadShape(tool_wait_s=0.0))
    sim = Simulator(config, smollm2_sim)
    results = sim.run(programs)
    lat = sim.call_latencies
    assert set(lat) == {"parallel", "join"}
    assert len(lat["join"]) == sum(1 for p in programs for s in p.stages if len(s[0].parents) > 1)
    assert len(lat["parallel"]) + len(lat["join"]) == sum(p.num_calls for p in programs)
    # A program takes at least its calls' critical path: a join and the slowest call of its fan-out per round.
    assert max(r.latency_s for r in results) >= max(lat["join"]) > 0
    chat = Simulator(config, smollm2_sim)
    chat.run(make_programs("chat", 4, rate=2.0, seed=1, shape=WorkloadShape(tool_wait_s=0.0)))
    assert set(chat.call_latencies) == {"chain"}
