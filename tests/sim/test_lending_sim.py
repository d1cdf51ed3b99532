"""KV lending in the simulator: the real agents, rManagers and gManager on the virtual clock (sim/lending.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from boundless.attention.backend import RemoteKV
from boundless.bench.longctx_trace import TraceShape, make_trace
from boundless.bench.workloads import ProgramSpec
from boundless.cli import main
from boundless.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.engine.attention_time import ChunkShape
from boundless.engine.executor import StepResult
from boundless.engine.request import RequestStatus
from boundless.engine.sampling_params import SamplingParams
from boundless.engine.scheduler import ScheduledChunk, SchedulerOutput
from boundless.sim.engine import SimulatedModel
from boundless.sim.failures import InstanceFailure
from boundless.sim.longctx import longctx_row, pool_tokens, trace_programs
from boundless.sim.profiles import load_profile
from boundless.sim.simulator import SimResult, Simulator

# Three instances of 64 blocks (1,024 tokens); plans as often as the bench's (before about every step at this
# scale), and creditors that may lend most of their pool, as `bench longctx` sets them: a 2.5x request needs it.
CONFIG = EngineConfig(
    cache=CacheConfig(num_kv_blocks=64, kv_host_gb=0.0), scheduler=SchedulerConfig(max_num_batched_tokens=256)
)
LENDING = dict(
    heartbeat_interval_s=0.1,
    lending_interval_s=0.1,
    lending_creditor_max_usage=0.9,
    lending_creditor_headroom=0.05,
)


@pytest.fixture(scope="module")
def model() -> SimulatedModel:
    return SimulatedModel.read(ModelConfig())


def _run(
    model: SimulatedModel, mode: str, net_gbps: float | None = None, num_short: int = 12, profile: str = "cpu"
) -> dict:
    shape = TraceShape(num_short=num_short, long_factors=(0.5, 1.5, 2.5))
    trace = make_trace(shape, pool_tokens(CONFIG, model), model.identity.vocab_size, rate=2.0, seed=0)
    programs = trace_programs(trace)
    cluster = ClusterConfig(instances=3, kv_lending="on" if mode == "lending" else "off", net_gbps=net_gbps, **LENDING)
    sim = Simulator(
        CONFIG, model, None, instances=3, cluster=cluster, profile=load_profile(profile), compact_prompts=False
    )
    return longctx_row(sim, sim.run(programs), programs, 2.0, mode)


def test_a_request_longer_than_one_pool_is_served_only_with_lending(model: SimulatedModel) -> None:
    pool = pool_tokens(CONFIG, model)
    separate = _run(model, "separate")
    lending = _run(model, "lending")
    # Separate instances refuse the 1.5x and 2.5x requests at admission and serve the rest.
    assert separate["refused"] == 2 and separate["served"] == separate["requests"] - 2
    assert separate["longest_served"] <= pool
    # Lending serves every request, the longest 2.5x one instance's pool, through moves the gManager planned
    # and steps whose attention went over blocks on creditors.
    assert lending["served"] == lending["requests"] and lending["refused"] == lending["unserved"] == 0
    assert lending["longest_served"] > 2 * pool
    assert lending["lending"]["moves"] > 0 and lending["lending"]["round_trips"] > 0
    assert len(lending["long_latency_s"]) == 3


def test_on_a_gpu_profile_the_steps_over_lent_blocks_cost_their_round_trips_too(model: SimulatedModel) -> None:
    # A roofline profile prices a step's passes from its rows (WindowCost): the executor must still price the
    # steps of a lending instance through the lending cost that wraps it, or lent blocks cost nothing.
    lending = _run(model, "lending", profile="a100-80gb")
    assert lending["lending"]["moves"] > 0 and lending["lending"]["round_trips"] > 0
    assert lending["lending"]["exposed_wait_s"] >= 0


def test_a_slower_network_makes_the_steps_over_lent_blocks_slower(model: SimulatedModel) -> None:
    fast = _run(model, "lending")
    slow = _run(model, "lending", net_gbps=0.05)
    assert slow["served"] == fast["served"]
    assert slow["lending"]["exposed_wait_s"] > fast["lending"]["exposed_wait_s"]
    longest = max(fast["long_latency_s"], key=fast["long_latency_s"].get)
    assert slow["long_latency_s"][longest] > fast["long_latency_s"][longest]


def test_a_lending_run_is_a_function_of_its_flags(tmp_path: Path) -> None:
    args = ["simulate", "--workload", "longctx", "--instances", "3", "--profile", "cpu", "--num-kv-blocks", "64"]
    args += ["--max-num-batched-tokens", "256", "--rates", "2", "--num-programs", "12", "--no-progress"]
    args += ["--heartbeat-interval-s", "0.1", "--lending-interval-s", "0.1", "--lending-creditor-max-usage", "0.9"]
    args += ["--lending-creditor-headroom", "0.05", "--long-factors", "0.5,1.5,2.5"]
    rows = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        out = tmp_path / f"{name}.json"
        assert main([*args, "--bench-seed", str(seed), "--json", str(out)]) == 0
        rows.append(json.loads(out.read_text())["rows"])
    assert rows[0] == rows[1] and rows[0] != rows[2]
    separate, lending = rows[0]
    assert separate["mode"] == "separate" and separate["refused"] == 2
    assert lending["mode"] == "lending" and lending["served"] == lending["requests"]
    assert lending["lending_stalled_at_s"] is None  # (a stall would leave requests unserved, and say so)


def test_lending_without_a_step_profile_is_a_command_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    # The lending step cost predicts from chunk shapes: the default three-constant model cannot.
    args = ["simulate", "--workload", "longctx", "--instances", "2", "--num-programs", "2", "--no-progress"]
    assert main(args) == 2
    assert "--kv-lending: the simulator needs a --profile" in capsys.readouterr().err


@pytest.mark.parametrize("lookahead, stalled_after", [(1, 4), (2, 3)])
def test_the_agent_reports_a_request_stalled_when_its_next_chunks_do_not_fit(
    model: SimulatedModel, lookahead: int, stalled_after: int
) -> None:
    # 64 blocks, 16 per chunk: after k chunks of a 1,200-token prompt (75 blocks), 64 - 16k are free. With one
    # chunk of lookahead the request counts as waiting for blocks once its next chunk no longer fits (after 4:
    # none free, 11 needed), with two once the next two do not (after 3: 16 free, 27 needed): a plan made from
    # that report lends before the engine has to evict it.
    cluster = ClusterConfig(instances=2, kv_lending="on", lending_lookahead_chunks=lookahead)
    sim = Simulator(CONFIG, model, None, instances=2, cluster=cluster, profile=load_profile("cpu"))
    assert sim.lending is not None
    core, agent = sim.instances["0"].core, sim.lending.agents["0"]
    core.add_request("long", list(range(100, 1300)), SamplingParams(max_tokens=8, ignore_eos=True))
    core.scheduler.grant("long")  # longer than the pool: the gManager's grant lets it start
    for chunk in range(1, 5):
        sched = core.schedule()
        core.finish_step(sched, core.execute(sched))
        agent.observe()
        waiting = agent.rm.local.waiting_blocks
        assert (waiting != ()) == (chunk >= stalled_after), (chunk, waiting)
        assert agent.rm.local.batch_size == (0 if waiting else 1)


def test_a_step_over_lent_blocks_costs_its_local_part_the_round_trip_and_the_creditors_compute(
    model: SimulatedModel,
) -> None:
    cluster = ClusterConfig(instances=3, kv_lending="on")
    sim = Simulator(CONFIG, model, None, instances=3, cluster=cluster, profile=load_profile("a100-80gb"))
    assert sim.lending is not None
    cost = sim.instances["0"].core.executor.cost  # type: ignore[attr-defined]
    base = cost.base
    params = SamplingParams(max_tokens=1)

    def decode(remote: tuple[RemoteKV, ...]) -> SchedulerOutput:
        chunk = ScheduledChunk("r", [5], 100_000, [], True, params, 0, (), first_block=0, remote=remote)
        return SchedulerOutput(chunks=[chunk])

    local = base.predict([ChunkShape(100_000 - 80_000, 1)])
    alone = cost.step_time(decode(()))
    assert alone == pytest.approx(base.predict([ChunkShape(100_000, 1)]))  # no lent blocks: the step model
    # 80 K of its 100 K tokens on creditor "1", which is mid-step: the debtor waits for the round trip and the
    # creditor's attention over them (less its own local attention), and the creditor's next step pays for it.
    sim.instances["1"].step = (SchedulerOutput(), StepResult({}, 0.0))  # (a step under way: any)
    lent = cost.step_time(decode((RemoteKV("1", ("m",), 80_000),)))
    creditor_work = base.predict([ChunkShape(100_000, 1)]) - local
    assert lent > local and sim.lending.data["1"].owed_s == pytest.approx(creditor_work)
    wire = 2 * 5e-6 + cost.shape.partial_bytes(1) / 25e9
    local_attention = local - base.predict([ChunkShape(0, 1)])
    assert lent == pytest.approx(local + 32 * max(0.0, wire + creditor_work / 32 - local_attention / 32))
    # An idle creditor computes the partials in its idle time.
    sim.instances["1"].step = None
    sim.lending.data["1"].owed_s = 0.0
    cost.step_time(decode((RemoteKV("1", ("m",), 80_000),)))
    assert sim.lending.data["1"].owed_s == 0.0 and sim.lending.data["1"].partials_served == 64


def test_a_report_taken_while_a_step_runs_sees_the_request_as_the_step_will_leave_it(model: SimulatedModel) -> None:
    """The engine loop holds its lock only between steps, so a heartbeat may report mid-step: the step's chunk has
    its blocks but its tokens are not yet counted. The report then counts them as computed (the step in flight), as
    it would right after the step; before, the chunk that fills the pool hid the stall from the planner."""
    cluster = ClusterConfig(instances=2, kv_lending="on")
    sim = Simulator(CONFIG, model, None, instances=2, cluster=cluster, profile=load_profile("cpu"))
    assert sim.lending is not None
    core, agent = sim.instances["0"].core, sim.lending.agents["0"]
    core.add_request("long", list(range(100, 1300)), SamplingParams(max_tokens=8, ignore_eos=True))
    core.scheduler.grant("long")  # longer than the pool: the gManager's grant lets it start
    for chunk in range(1, 5):
        sched = core.schedule()
        agent.observe()
        during = agent.rm.local
        core.finish_step(sched, core.execute(sched))
        agent.observe()
        assert during == agent.rm.local, chunk
    assert agent.rm.local.waiting_blocks == (11,)  # after 4 chunks: the pool is full, the next chunk needs 11


def test_an_instance_whose_step_outlasts_the_heartbeat_timeout_stays_in_the_plans(model: SimulatedModel) -> None:
    """A step of 3 s against a 1 s heartbeat timeout: the instance reports at every heartbeat meanwhile (as the real
    one does), so the gManager keeps it live and sees its stalled request. Before, a busy instance reported at its
    step's end only, and the gManager left it out of its plans (the debtor that needed one most)."""
    cluster = ClusterConfig(
        instances=2, kv_lending="on", heartbeat_interval_s=0.5, heartbeat_timeout_s=1.0, lending_interval_s=0.5
    )
    sim = Simulator(CONFIG, model, None, instances=2, cluster=cluster, profile=load_profile("cpu"))
    assert sim.lending is not None
    core, gm = sim.instances["0"].core, sim.lending.lending.gm
    core.add_request("long", list(range(100, 1300)), SamplingParams(max_tokens=8, ignore_eos=True))
    core.scheduler.grant("long")  # longer than the pool: the gManager's grant lets it start
    for _ in range(3):
        sched = core.schedule()
        core.finish_step(sched, core.execute(sched))
    core.schedule()  # the 4th chunk, which fills the pool, runs for 3 s
    sim.instances["0"].step = (SchedulerOutput(), StepResult({}, 0.0))  # (a step under way: any)
    for _ in range(6):
        sim.clock.now += 0.5
        sim.lending.heartbeat()
    live = {hb.instance_id: hb for hb in gm.live()}
    assert set(live) == {"0", "1"}
    assert live["0"].instance.waiting_blocks == (11,)


def test_a_request_longer_than_its_pool_is_served_at_light_load(model: SimulatedModel) -> None:
    """One request at a time (every step a batch of one): the gManager's model is fitted from steps of one batch
    size, charging a step's fixed cost per request, and plans. Before, it refused such samples and never planned:
    the 1.5x request filled its instance and waited for good."""
    shape = TraceShape(num_short=12, long_factors=(1.5,))
    trace = make_trace(shape, pool_tokens(CONFIG, model), model.identity.vocab_size, rate=0.2, seed=0)
    programs = trace_programs(trace)
    cluster = ClusterConfig(instances=3, kv_lending="on", **LENDING)
    sim = Simulator(
        CONFIG, model, None, instances=3, cluster=cluster, profile=load_profile("cpu"), compact_prompts=False
    )
    row = longctx_row(sim, sim.run(programs), programs, 0.2, "lending")
    assert row["served"] == row["requests"] and row["unserved"] == 0
    assert row["longest_served"] > pool_tokens(CONFIG, model)
    assert sim.lending is not None
    fitted = sim.lending.lending.gm.model()
    assert fitted is not None and fitted.base_s == 0.0 and row["lending"]["moves"] > 0


def test_a_swapped_out_request_waits_for_its_local_blocks_only(model: SimulatedModel) -> None:
    """With a host tier, a request with 10 blocks on a creditor is swapped out: the planner sees it waiting for its
    75 blocks less those 10, which stay on the creditor (before, all 75, as if lent blocks were local)."""
    config = EngineConfig(
        cache=CacheConfig(num_kv_blocks=64, kv_host_gb=0.1),
        scheduler=SchedulerConfig(policy="fcfs", max_num_batched_tokens=256),
    )
    cluster = ClusterConfig(instances=2, kv_lending="on")
    sim = Simulator(config, model, None, instances=2, cluster=cluster, profile=load_profile("cpu"))
    assert sim.lending is not None
    core, agent = sim.instances["0"].core, sim.lending.agents["0"]
    core.add_request("a", list(range(100, 200)), SamplingParams(max_tokens=400, ignore_eos=True))
    core.add_request("b", list(range(300, 1500)), SamplingParams(max_tokens=8, ignore_eos=True))
    core.scheduler.grant("b")  # longer than the pool: the gManager's grant lets it start
    b = core.scheduler.requests["b"]

    def step() -> None:
        sched = core.schedule()
        core.finish_step(sched, core.execute(sched))

    for _ in range(3):
        step()
    assert agent.move_kvcache("b", 10, "1")
    while b.status is RequestStatus.RUNNING:  # until b, out of room, is swapped out (to host memory)
        step()
    assert b.status is RequestStatus.SWAPPED and core.kv.num_lent_blocks("b") == 10
    agent.observe()
    assert agent.rm.local.waiting_blocks == (core.kv.blocks_for_tokens(b.num_tokens) - 10,) == (65,)


# -- failures: the real cluster's PeerLost and PeerBack, driven by the simulated dispatcher ----------------------


def _failing(
    model: SimulatedModel, failures: list[InstanceFailure], **knobs: float
) -> tuple[Simulator, list[ProgramSpec]]:
    """The trace of ``_run`` on three lending instances, with ``failures``; a lost instance is restarted 1 s after its
    loss and is back 2 s later, and a round trip to a creditor that stopped answering fails after 1 s. In the healthy
    run, instance 1 holds 28 blocks lent by 0 at 8.5 s (0's step in flight then attends over them; 2 holds 32 more),
    and at 11 s 0 and 1 hold 38 and 14 blocks lent by 2. The long requests start one at a time, each on the
    gManager's grant (``cluster/lending_grants.py``)."""
    shape = TraceShape(num_short=12, long_factors=(0.5, 1.5, 2.5))
    programs = trace_programs(make_trace(shape, pool_tokens(CONFIG, model), model.identity.vocab_size, 2.0, 0))
    cluster = ClusterConfig(
        instances=3, kv_lending="on", restart_delay_s=1.0, kv_handoff_timeout_s=1.0, **{**LENDING, **knobs}
    )
    sim = Simulator(
        CONFIG,
        model,
        None,
        instances=3,
        cluster=cluster,
        profile=load_profile("cpu"),
        compact_prompts=False,
        failures=failures,
        instance_startup_s=2.0,
    )
    return sim, programs


def test_a_request_the_live_instances_cannot_hold_fails_after_the_grant_timeout(model: SimulatedModel) -> None:
    # Instance 2 is lost for good at 1 s: the 2.5-pool request (arriving later) needs its host and both others
    # lending (0.9 of 64 blocks each), so no grant can ever come. It fails 5 s after it was first seen so; the
    # rest are served, the 1.5-pool one on the two left.
    sim, programs = _failing(model, [InstanceFailure("2", 1.0)], max_restarts=0, lending_grant_timeout_s=5.0)
    results = sim.run(programs)
    assert sim.lending is not None
    assert sim.lending.totals()["requests_refused"] == 1 and sim.lending.lending.gm.counters.grants_refused == 1
    failed = [(p, r) for p, r in zip(programs, results, strict=True) if r.failed_calls]
    assert len(failed) == 1 and failed[0][1].finished
    pool = pool_tokens(CONFIG, model)
    (call,) = failed[0][0].stages[0]
    assert call.new_input > 2 * pool  # the 2.5-pool request
    assert all(r.finished for r in results) and sim.lending_stalled_at is None


def _recomputed_at(sim: Simulator, instance_id: str, into: dict[str, float]) -> Callable[[float], None]:
    """A progress callback that records in ``into["at"]`` when ``instance_id`` first recomputed lost blocks."""
    assert sim.lending is not None
    rm = sim.lending.agents[instance_id].rm

    def watch(now: float) -> None:
        if rm.counters.blocks_recomputed:
            into.setdefault("at", now)

    return watch


def _loans(sim: Simulator, creditor: str, debtor: str) -> int:
    """Blocks ``creditor`` holds lent by ``debtor`` (its rManager's ledger)."""
    assert sim.lending is not None
    return sum(len(loan.block_ids) for loan in sim.lending.agents[creditor].rm.loans.values() if loan.debtor == debtor)


def _spans_on(sim: Simulator, debtor: str, creditor: str) -> int:
    """Blocks of ``debtor``'s requests it records on ``creditor``."""
    assert sim.lending is not None
    spans = sim.lending.agents[debtor].rm.spans.values()
    return sum(s.num_blocks for request in spans for s in request if s.creditor == creditor)


def _assert_served_and_released(sim: Simulator, results: list[SimResult], programs: list[ProgramSpec]) -> None:
    """Every request served with every token, and at the end no block lent, borrowed or held in any pool."""
    assert all(r.finished and not r.failed_calls for r in results)
    assert [r.output_tokens for r in results] == [p.output_tokens for p in programs]
    assert sim.lending is not None
    for iid, agent in sim.lending.agents.items():
        assert not agent.rm.loans and not agent.rm.spans and agent.core.kv.pool.num_used == 0, iid


def test_a_creditor_lost_while_it_lends_costs_its_debtor_a_recompute_and_nothing_else(model: SimulatedModel) -> None:
    sim, programs = _failing(model, [InstanceFailure("1", 8.5)])
    seen: dict[str, tuple[int, bool, float]] = {}
    recomputed_at: dict[str, float] = {}
    recomputed = _recomputed_at(sim, "0", recomputed_at)

    def watch(now: float) -> None:
        recomputed(now)
        assert sim.lending is not None
        if "after" not in seen:
            heard = "1" in sim.lending.lending.gm.heartbeats
            state = (_spans_on(sim, "0", "1"), heard, sim.instances["0"].step_ends)
            seen["after" if now >= 8.5 else "before"] = state

    results = sim.run(programs, watch)
    assert seen["before"][:2] == (28, True) and seen["before"][2] < 8.5 + 1.0
    # Told of the loss at once, the gManager drops 1 and debtor 0 recomputes the requests whose blocks were on 1;
    # 0's step in flight over them ends when its round trip times out (1 s), failed.
    assert seen["after"] == (0, False, 9.5) and recomputed_at["at"] == 8.5
    assert sim.lost == {"1": 8.5} and sim.restarted == {"1": 11.5}
    assert sim.lending is not None
    assert sim.lending.agents["0"].stats.requests_recomputed > 0
    assert sim.lending.agents["0"].rm.counters.blocks_recomputed == 28
    _assert_served_and_released(sim, results, programs)
    # Back, 1 is a fresh instance with a fresh agent, which lends again; the lost one's counts stay in the totals.
    assert [a.instance_id for a in sim.lending.retired] == ["1"]
    assert sim.lending.agents["1"].stats.moves_in > 0
    totals = sim.lending.totals()
    assert totals["requests_recomputed"] == sim.lending.agents["0"].stats.requests_recomputed
    assert totals["moves"] == sum(a.stats.moves_out for a in [*sim.lending.retired, *sim.lending.agents.values()])


def test_a_debtor_lost_has_its_creditors_free_the_blocks_they_held_for_it(model: SimulatedModel) -> None:
    sim, programs = _failing(model, [InstanceFailure("2", 11.0)])
    seen: dict[str, tuple[int, int]] = {}

    def watch(now: float) -> None:
        if "after" not in seen:
            seen["after" if now >= 11.0 else "before"] = (_loans(sim, "0", "2"), _loans(sim, "1", "2"))

    results = sim.run(programs, watch)
    assert seen["before"] == (38, 14)
    assert seen["after"] == (0, 0)  # freed as the loss is known, not when the trace ends
    assert sim.lost == {"2": 11.0} and sim.restarted == {"2": 14.0}
    _assert_served_and_released(sim, results, programs)


def test_a_creditor_that_hangs_fails_its_debtor_s_step_over_its_blocks(model: SimulatedModel) -> None:
    """Hung at 8.5 s, instance 1 is lost at 13.5 s (the heartbeat timeout); before that, its debtor's step over its
    blocks waits for the round trip in vain, fails at 9.5 s, and the debtor takes 1 as lost itself, as the real
    agent does (``InstanceLending.step_failed``). Hung, 1 answers no move (the gManager still plans with it)."""
    sim, programs = _failing(model, [InstanceFailure("1", 8.5, hang=True)])
    assert sim.lending is not None
    hung, moves_in = sim.lending.agents["1"], []
    recomputed_at: dict[str, float] = {}
    recomputed = _recomputed_at(sim, "0", recomputed_at)

    def watch(now: float) -> None:
        recomputed(now)
        if now < 8.5:
            moves_in[:] = [hung.stats.moves_in]

    results = sim.run(programs, watch)
    assert sim.lost == {"1": 13.5} and recomputed_at["at"] == pytest.approx(9.5)
    assert moves_in == [hung.stats.moves_in] == [7]
    assert sim.lending is not None and sim.lending.agents["0"].rm.counters.blocks_recomputed == 28
    _assert_served_and_released(sim, results, programs)


def test_a_lending_run_with_failures_is_a_function_of_its_flags_with_fast_forward_and_without(tmp_path: Path) -> None:
    args = ["simulate", "--workload", "longctx", "--instances", "3", "--profile", "cpu", "--num-kv-blocks", "64"]
    args += ["--max-num-batched-tokens", "256", "--rates", "2", "--num-programs", "12", "--no-progress"]
    args += ["--heartbeat-interval-s", "0.1", "--lending-interval-s", "0.1", "--lending-creditor-max-usage", "0.9"]
    args += ["--lending-creditor-headroom", "0.05", "--long-factors", "0.5,1.5,2.5", "--kv-modes", "lending"]
    args += ["--fail", "1@8.5,2@12:hang", "--restart-delay-s", "1", "--instance-startup-s", "2"]
    rows = []
    for name, flag in (("a", "--fast-forward"), ("b", "--fast-forward"), ("c", "--no-fast-forward")):
        out = tmp_path / f"{name}.json"
        assert main([*args, flag, "--json", str(out)]) == 0
        rows.append(json.loads(out.read_text())["rows"])
    assert rows[0] == rows[1] == rows[2]
    (row,) = rows[0]
    assert row["served"] == row["requests"] and row["instances_lost"] == {"1": 8.5, "2": 17.0}
    assert row["lending"]["requests_recomputed"] > 0


# Chat programs on two 48-block pools (768 tokens) that admit the cluster's memory. Without the deadlock breaker,
# at 24 s a conversation of 814 tokens held one pool and one of 778 the other; neither instance could lend, no step
# ran again, and 3 of the 12 programs never finished. With the breaker alone, 3 requests were held back (each a
# prefill recomputed); with the gManager's grants the requests longer than a pool start one at a time.
OVER_ONE_POOL = ["simulate", "--workload", "chat", "--instances", "2", "--kv-lending", "on", "--profile", "cpu"]
OVER_ONE_POOL += ["--num-kv-blocks", "48", "--rates", "1", "--num-programs", "12", "--policies", "fcfs"]


def test_requests_over_one_pool_start_one_at_a_time_on_the_gmanager_s_grants(tmp_path: Path) -> None:
    out = tmp_path / "granted.json"
    assert main([*OVER_ONE_POOL, "--no-progress", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["programs_finished"] == row["programs"] == 12 and row["lending_stalled_at_s"] is None
    lent = row["lending"]
    assert lent["requests_granted"] > 0 and lent["moves"] > 0 and lent["requests_held"] == 0


def test_requests_waiting_for_room_no_instance_can_lend_are_reported_not_hidden(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A creditor keeps 99% of its pool: nothing is ever lent, so requests over one pool wait for good.
    out = tmp_path / "stall.json"
    args = [*OVER_ONE_POOL, "--lending-creditor-headroom", "0.99", "--no-progress", "--json", str(out)]
    assert main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["programs_finished"] < row["programs"] and 0 < row["lending_stalled_at_s"] < row["simulated_s"]
    printed = capsys.readouterr().out
    assert f"{row['programs'] - row['programs_finished']} of 12 programs did not finish: KV lending stalled" in printed
    assert "these figures are invalid" in printed


def test_lending_engines_admit_the_cluster_s_pools_or_one_as_the_server_does(model: SimulatedModel) -> None:
    cluster = ClusterConfig(instances=3, kv_lending="on", **LENDING)
    pool = pool_tokens(CONFIG, model)
    spans = Simulator(CONFIG, model, None, instances=3, cluster=cluster, profile=load_profile("cpu"))
    assert spans.max_model_len == 3 * pool  # as `bench longctx` sizes them
    served = Simulator(CONFIG, model, None, instances=3, cluster=cluster, profile=load_profile("cpu"), lending_pools=1)
    assert served.max_model_len == pool and served.lending is not None  # as `serve --kv-lending on` admits
