"""Instances that fail in the simulator (``--fail``): the real dispatchers fail their calls over, KV streams with
them time out, every program still finishes, and a lost instance is restarted and serves again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boundless.bench.workloads import ProgramSpec, WorkloadShape, agent_sessions, make_programs
from boundless.cli import main
from boundless.cluster.links import Link
from boundless.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig, SchedulerConfig
from boundless.kv.remote_moves import RemoteRecv, RemoteSend
from boundless.kv.transfer import HOST, BlockRef
from boundless.sim.engine import SimulatedModel
from boundless.sim.failures import InstanceFailure, check_failures, parse_failures
from boundless.sim.profiles import load_profile
from boundless.sim.remote import KVFabric
from boundless.sim.simulator import Placement, SimResult, Simulator

SHAPE = WorkloadShape(scale=0.05, call_scale=0.25, tool_wait_s=0.1)  # as tests/sim/test_pd_sim.py


@pytest.fixture(scope="module")
def model() -> SimulatedModel:
    return SimulatedModel.read(ModelConfig())


def _cluster_run(
    model: SimulatedModel,
    failures: list[InstanceFailure],
    programs: list[ProgramSpec] | None = None,
    cluster: ClusterConfig | None = None,
    startup_s: float = 30.0,
) -> tuple[Simulator, list[SimResult]]:
    config = EngineConfig(cache=CacheConfig(num_kv_blocks=200), scheduler=SchedulerConfig(policy="plas"))
    cluster = cluster or ClusterConfig(instances=4)
    sim = Simulator(
        config, model, instances=cluster.instances, cluster=cluster, failures=failures, instance_startup_s=startup_s
    )
    return sim, sim.run(programs or make_programs("mapreduce", 16, rate=2.0, seed=1))


def _pd_run(
    model: SimulatedModel,
    failures: list[InstanceFailure],
    step_timeout_s: float = 120.0,
    restart_delay_s: float = 5.0,
    startup_s: float = 30.0,
) -> tuple[Simulator, list[SimResult]]:
    config = EngineConfig(
        cache=CacheConfig(num_kv_blocks=400, kv_disk_path="unused-by-the-simulator", kv_host_gb=0.5),
        scheduler=SchedulerConfig(policy="fcfs"),
    )
    cluster = ClusterConfig(
        prefill_instances=2,
        decode_instances=2,
        kv_path="basic",
        kv_handoff_timeout_s=2.0,
        step_timeout_s=step_timeout_s,
        restart_delay_s=restart_delay_s,
    )
    profile = load_profile("h100")
    sim = Simulator(config, model, cluster=cluster, profile=profile, failures=failures, instance_startup_s=startup_s)
    return sim, sim.run(agent_sessions(12, 0.0, 1, SHAPE))


def _assert_nothing_lost(sim: Simulator, results: list[SimResult], programs: list[ProgramSpec]) -> None:
    assert all(r.finished for r in results) and not any(r.failed_calls for r in results)
    assert [r.output_tokens for r in results] == [p.output_tokens for p in programs]  # every token, once
    # The live engines hold nothing at the end: no call, no stream waiting for a peer that is gone.
    assert not [iid for iid, inst in sim.instances.items() if not inst.dead and inst.core.has_unfinished()]


def _moved(sim: Simulator, instance_id: str) -> set[str]:
    """Calls placed on ``instance_id`` and on another instance too (failed over)."""
    on = {p.request_id for p in sim.placements if p.instance_id == instance_id}
    return on & {p.request_id for p in sim.placements if p.instance_id != instance_id}


def _assert_failed_over_after(sim: Simulator, instance_id: str, failed_at: float) -> None:
    """The calls of an instance that stopped answering at ``failed_at`` but was found out only later: every call
    placed on it failed over with its whole output, those the router sent it in between too (it took them and ran
    none), and none was placed on it once it was lost (until its restart, if it came back)."""
    moved = _moved(sim, instance_id)
    assert sim.dispatcher is not None and sim.dispatcher.num_failovers == len(moved) > 0
    assert all(sim.call_outcomes[r].output_tokens == sim.call_outcomes[r].max_tokens for r in moved)
    late = {p.request_id for p in sim.placements if p.instance_id == instance_id and p.at_s > failed_at}
    assert late and late <= moved
    assert not _placed_while_down(sim, instance_id)


def _placed_while_down(sim: Simulator, instance_id: str) -> list[Placement]:
    """Calls placed on ``instance_id`` between its loss and its restart's return (or the run's end)."""
    back = sim.restarted.get(instance_id, float("inf"))
    return [p for p in sim.placements if p.instance_id == instance_id and sim.lost[instance_id] <= p.at_s < back]


def test_failure_flags_are_parsed_and_checked() -> None:
    assert parse_failures("1@30, p0@12.5:hang") == [InstanceFailure("1", 30.0), InstanceFailure("p0", 12.5, True)]
    assert parse_failures("d1@2:stuck") == [InstanceFailure("d1", 2.0, stuck=True)]
    four, roles = ClusterConfig(instances=4), ClusterConfig(prefill_instances=1, decode_instances=2)
    check_failures(parse_failures("0@1,3@2"), four)
    check_failures(parse_failures("p0@1,d1@2"), roles)
    check_failures(parse_failures("1@1"), ClusterConfig(instances=2, kv_lending="on"))  # (test_lending_sim.py)
    for text in ("1", "1@", "@3", "1@soon", "1@3:sleep"):
        with pytest.raises(ValueError):
            parse_failures(text)
    for text, cluster, why in (
        ("4@1", four, "no instance '4'"),
        ("0@1", roles, "no instance '0'"),
        ("1@-1", four, "not negative"),
        ("1@inf", four, "not negative"),
        ("1@1,1@2", four, "more than once"),
        ("0@1", ClusterConfig(instances=1), "one instance"),
    ):
        with pytest.raises(ValueError, match=why):
            check_failures(parse_failures(text), cluster)


def test_simulate_refuses_a_bad_fail_flag_before_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--fail: no instance '9'"):
        main(["simulate", "--instances", "2", "--fail", "9@1", "--no-progress"])
    with pytest.raises(SystemExit, match="--fail: one instance"):
        main(["simulate", "--fail", "0@1", "--no-progress"])
    with pytest.raises(SystemExit, match="--instance-startup-s: a number of seconds, not negative"):
        main(["simulate", "--instances", "2", "--fail", "1@1", "--instance-startup-s", "-1", "--no-progress"])
    assert "rate/s" not in capsys.readouterr().out  # no row ran


def test_a_run_with_a_failure_is_a_function_of_its_seed(model: SimulatedModel) -> None:
    sim, results = _cluster_run(model, [InstanceFailure("1", 10.0)])
    again, again_results = _cluster_run(model, [InstanceFailure("1", 10.0)])
    assert results == again_results and sim.placements == again.placements and sim.lost == again.lost
    _, healthy = _cluster_run(model, [])
    assert results != healthy  # the failure changed the run


def test_a_crashed_instance_s_calls_finish_elsewhere_with_the_tokens_they_had(model: SimulatedModel) -> None:
    programs = make_programs("mapreduce", 16, rate=2.0, seed=1)
    sim, results = _cluster_run(model, [InstanceFailure("1", 10.0)], programs)
    _assert_nothing_lost(sim, results, programs)
    assert sim.lost == {"1": 10.0}  # a crash is seen at once
    moved = _moved(sim, "1")
    assert sim.dispatcher is not None and sim.dispatcher.num_failovers == len(moved) > 0
    # Each moved call produced exactly what it asked for: the tokens it had (resent with the call) and the rest.
    assert all(sim.call_outcomes[r].output_tokens == sim.call_outcomes[r].max_tokens for r in moved)
    frozen = sim.instances["1"].core.scheduler.requests  # the dead engine as it stopped
    assert any(frozen[r].num_output_tokens > 0 for r in moved)  # some had tokens out before the crash
    assert not _placed_while_down(sim, "1")


def test_a_hung_instance_is_lost_when_its_heartbeat_times_out(model: SimulatedModel) -> None:
    programs = make_programs("mapreduce", 16, rate=2.0, seed=1)
    sim, results = _cluster_run(model, [InstanceFailure("1", 6.0, hang=True)], programs)
    _assert_nothing_lost(sim, results, programs)
    assert sim.lost == {"1": 6.0 + ClusterConfig().heartbeat_timeout_s}
    _assert_failed_over_after(sim, "1", 6.0)


def test_an_instance_stuck_in_a_step_is_lost_by_the_step_watchdog(model: SimulatedModel) -> None:
    programs = make_programs("mapreduce", 16, rate=2.0, seed=1)
    runs = {}
    for limit in (3.0, 1.0):
        cluster = ClusterConfig(instances=4, step_timeout_s=limit)
        runs[limit] = _cluster_run(model, [InstanceFailure("1", 6.0, stuck=True)], programs, cluster)
    sim, results = runs[3.0]
    _assert_nothing_lost(sim, results, programs)
    started = sim.instances["1"].step_started  # the step it was stuck in
    assert started <= 6.0  # it was mid-step at 6 s: that step never ended
    # Found at a heartbeat past the limit, a heartbeat interval at the latest; the same step with a lower limit: sooner.
    assert sim.lost["1"] == pytest.approx(started + 3.0 + ClusterConfig().heartbeat_interval_s)
    assert runs[1.0][0].lost["1"] == pytest.approx(sim.lost["1"] - 2.0)
    _assert_failed_over_after(sim, "1", 6.0)


def test_a_pd_decode_engine_stuck_in_a_step_is_lost_and_every_program_finishes(model: SimulatedModel) -> None:
    programs = agent_sessions(12, 0.0, 1, SHAPE)
    sim, results = _pd_run(model, [InstanceFailure("d0", 0.8, stuck=True)], step_timeout_s=2.0)
    _assert_nothing_lost(sim, results, programs)
    assert sim.lost["d0"] == pytest.approx(
        sim.instances["d0"].step_started + 2.0 + ClusterConfig().heartbeat_interval_s
    )
    assert sim.dispatcher is not None and sim.dispatcher.num_failovers > 0


@pytest.mark.parametrize("lost", ["d0", "p0"])
def test_a_pd_cluster_loses_an_engine_and_every_program_finishes(model: SimulatedModel, lost: str) -> None:
    programs = agent_sessions(12, 0.0, 1, SHAPE)
    sim, results = _pd_run(model, [InstanceFailure(lost, 0.8)])
    _assert_nothing_lost(sim, results, programs)
    assert sim.lost == {lost: 0.8} and sim.dispatcher is not None and sim.dispatcher.num_failovers > 0
    assert not _placed_while_down(sim, lost)
    if lost == "p0":  # a decode engine waited for a handoff the lost PE never finished, and gave up on it
        timeouts = [inst.core.stats().remote_io.recv_timeouts for iid, inst in sim.instances.items() if iid != lost]
        assert sum(timeouts) > 0


def test_a_pd_decode_engine_that_hangs_fails_the_handoffs_sent_to_it(model: SimulatedModel) -> None:
    programs = agent_sessions(12, 0.0, 1, SHAPE)
    sim, results = _pd_run(model, [InstanceFailure("d1", 0.8, hang=True)])
    _assert_nothing_lost(sim, results, programs)
    assert sim.dispatcher is not None and sim.dispatcher.num_failovers > 0
    sends = [sim.instances[p].core.stats().remote_io for p in ("p0", "p1")]
    assert sum(s.send_failures for s in sends if s is not None) > 0  # the PEs' streams to it timed out


def test_a_lost_peer_s_streams_time_out_and_those_that_ended_stand() -> None:
    woken: list[tuple[str, float]] = []
    fabric = KVFabric(lambda iid, t: woken.append((iid, t)), timeout_s=2.0)
    a, b = (fabric.attach(x, x, Link(f"net-{x}", 1e9), 0.0, 1000) for x in ("a", "b"))
    src = (BlockRef(HOST, 0),)
    b.start([RemoteRecv(1, "a", 7, (0,), 1), RemoteRecv(2, "a", 8, (1,), 1)], [], 0.0, 0.0)
    a.start([], [RemoteSend(1, "b", 7, src, 1)], 0.0, 0.0)  # arrives at 1e-6 s: ends before the loss
    a.start([], [RemoteSend(2, "b", 9, src, 1, layerwise=True)], 0.0, 5.0)  # ends with its step, after the loss
    fabric.lose("a", 1.0)
    b.start([RemoteRecv(3, "a", 9, (2,), 1)], [], 1.5, 1.5)  # posted after: its stream arrives after the loss
    # A deadline wakes the engine; an idle engine does not sleep through it as through a stream (calls may come).
    assert b.next_done() == 1e-6 and b.report(1.0).recvs and b.next_done() is None
    report = b.report(10.0)
    assert {(d.recv_id, d.num_valid, d.error is None) for d in report.recvs} == {(2, 0, False), (3, 0, False)}
    assert report.stats is not None and report.stats.recv_timeouts == 2 and report.stats.streams_received == 1
    assert ("b", 2.0) in woken and ("b", 3.5) in woken  # receive 2 at its deadline (posted at 0), 3 at 1.5 + 2
    fabric.lose("b", 1.0)
    a2 = fabric.attach("c", "c", Link("net-c", 1e9), 0.0, 1000)
    a2.start([], [RemoteSend(3, "b", 1, src, 1)], 4.0, 4.0)  # to a lost peer: nobody takes it
    assert [(d.send_id, d.error is not None) for d in a2.report(6.0).sends] == [(3, True)]


def test_simulate_reports_the_failover(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    args = ["simulate", "--workload", "mapreduce", "--instances", "4", "--policies", "plas", "--rates", "2"]
    args += ["--num-programs", "16", "--num-kv-blocks", "200", "--bench-seed", "1", "--fail", "1@10"]
    args += ["--restart-delay-s", "1", "--instance-startup-s", "2"]
    assert main([*args, "--no-progress", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["instances_lost"] == {"1": 10.0} and row["failovers"] > 0 and row["failed_calls"] == 0
    assert row["programs_finished"] == row["programs"] == 16
    assert row["instances_restarted"] == {"1": 13.0} and row["calls_after_restart"]["1"] > 0
    printed = capsys.readouterr().out
    assert f"lost 1 at 10 s; {row['failovers']} calls failed over" in printed
    assert f"restarted 1 at 13 s ({row['calls_after_restart']['1']} calls placed on it since)" in printed


@pytest.mark.slow  # (5 s; each failure's handling stays in the fast suite)
def test_failures_give_the_same_rows_with_fast_forward_and_without(tmp_path: Path) -> None:
    args = ["simulate", "--workload", "agent", "--policies", "fcfs", "--rates", "0", "--num-programs", "12"]
    args += ["--scale", "0.05", "--call-scale", "0.25", "--roles", "2:2", "--kv-paths", "basic,dualpath"]
    args += ["--profile", "h100", "--num-kv-blocks", "400", "--kv-host-gb", "0.5", "--kv-disk-path", "unused"]
    args += ["--kv-disk-gb", "1", "--kv-handoff-timeout-s", "2", "--fail", "d0@0.8,p1@0.9:hang", "--no-progress"]
    rows = []
    for flag in ("--fast-forward", "--no-fast-forward"):
        out = tmp_path / f"{flag}.json"
        assert main([*args, flag, "--json", str(out)]) == 0
        rows.append(json.loads(out.read_text())["rows"])
    assert rows[0] == rows[1]
    assert all(r["failovers"] > 0 and r["programs_finished"] == r["programs"] == 24 for r in rows[0])
    assert [r["instances_lost"] for r in rows[0]] == [{"d0": 0.8, "p1": 5.9}] * 2


def test_a_failure_due_after_the_last_program_does_not_happen(model: SimulatedModel) -> None:
    programs = make_programs("chat", 8, rate=2.0, seed=1)
    healthy, results = _cluster_run(model, [], programs)
    late, late_results = _cluster_run(model, [InstanceFailure("1", 1e6, hang=True)], programs)
    assert late_results == results and late.clock.now == healthy.clock.now and late.lost == {}


def _restart_run(model: SimulatedModel, max_restarts: int = 3) -> tuple[Simulator, list[SimResult]]:
    """Instance 1 of 4 crashes at 10 s; its restart is due 1 s later and up 2 s after that (at 13 s)."""
    cluster = ClusterConfig(instances=4, restart_delay_s=1.0, max_restarts=max_restarts)
    return _cluster_run(model, [InstanceFailure("1", 10.0)], cluster=cluster, startup_s=2.0)


def test_a_crashed_instance_is_restarted_empty_and_serves_calls_once_back(model: SimulatedModel) -> None:
    programs = make_programs("mapreduce", 16, rate=2.0, seed=1)
    sim, results = _restart_run(model)
    _assert_nothing_lost(sim, results, programs)
    assert sim.lost == {"1": 10.0} and sim.restarted == {"1": 13.0}  # the delay, then the startup
    assert not _placed_while_down(sim, "1")
    after = [p for p in sim.placements if p.instance_id == "1" and p.at_s >= 13.0]
    assert len(after) >= 10  # it takes its share again
    # A fresh engine served them: it generated their tokens and nothing from before the crash.
    assert sim.instances["1"].core.stats().generation_tokens == sum(
        sim.call_outcomes[p.request_id].output_tokens for p in after
    )
    assert sim.dispatcher is not None and sim.dispatcher.restarts.counts("1") == (1, 1, 0)
    again = _restart_run(model)
    assert again[1] == results and again[0].placements == sim.placements  # a function of its flags
    # Without restarts the instance stays lost, and the others serve the rest.
    never, never_results = _restart_run(model, max_restarts=0)
    _assert_nothing_lost(never, never_results, programs)
    assert never.restarted == {} and not [p for p in never.placements if p.instance_id == "1" and p.at_s >= 10.0]


def test_a_pd_decode_engine_lost_comes_back_and_decodes_again(model: SimulatedModel) -> None:
    programs = agent_sessions(12, 0.0, 1, SHAPE)
    sim, results = _pd_run(model, [InstanceFailure("d0", 0.8)], restart_delay_s=0.1, startup_s=0.1)
    _assert_nothing_lost(sim, results, programs)
    assert sim.lost == {"d0": 0.8} and sim.restarted == {"d0": pytest.approx(1.0)}
    assert sim.instances["d0"].core.stats().generation_tokens > 0  # the restarted DE decoded calls
