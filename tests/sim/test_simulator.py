"""The simulator drives the real scheduler and policies in virtual time: deterministic, and policy-sensitive."""

from __future__ import annotations

import statistics

from boundless.bench.workloads import make_programs
from boundless.config import SchedulerConfig
from boundless.sim.simulator import CostModel, Simulator


def _latencies(policy: str, programs) -> list[float]:
    sim = Simulator(SchedulerConfig(policy=policy, max_num_seqs=16), num_blocks=160, num_host_blocks=512)
    results = sim.run(programs)
    assert len(results) == len(programs) and all(r.finish_s >= r.arrival_s for r in results)
    return [r.latency_s for r in results]


def _avg_latency(policy: str, programs) -> float:
    return statistics.fmean(_latencies(policy, programs))


def test_runs_are_deterministic_and_complete() -> None:
    programs = make_programs("chat", 40, rate=0.3, seed=1)
    assert _avg_latency("plas", programs) == _avg_latency("plas", programs)
    sim = Simulator(SchedulerConfig(policy="fcfs"))
    results = sim.run(programs)
    assert sum(r.output_tokens for r in results) == sum(p.output_tokens for p in programs)


def test_memory_bound_load_separates_the_policies() -> None:
    # A small KV pool (as on a GPU): under fcfs, long programs' growing contexts hold the memory.
    fcfs_total = plas_total = 0.0
    for seed in range(4):
        programs = make_programs("chat", 60, rate=0.4, seed=seed)
        fcfs, plas = _latencies("fcfs", programs), _latencies("plas", programs)
        fcfs_total += statistics.fmean(fcfs)
        plas_total += statistics.fmean(plas)
        # The mechanism: short programs (one or two calls) no longer wait behind long ones.
        short = [i for i, p in enumerate(programs) if p.num_calls <= 2]
        assert statistics.fmean(plas[i] for i in short) < statistics.fmean(fcfs[i] for i in short) / 1.3
    assert plas_total < fcfs_total / 1.2


def test_cost_model_charges_prefill_by_token() -> None:
    cost = CostModel(base_s=0.01, per_token_s=0.001, per_seq_s=0.002)
    assert cost.step_time(num_tokens=4, num_seqs=4) == 0.01 + 4 * 0.002
    assert cost.step_time(num_tokens=104, num_seqs=4) == 0.01 + 4 * 0.002 + 100 * 0.001
