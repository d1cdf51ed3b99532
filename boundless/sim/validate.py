"""``boundless simulate validate``: the real engine and the simulator on the same workloads, side by side.

For every workload (``--workloads``, chat and map-reduce by default) and every cluster size (``--instances``,
one instance and a 2-instance cluster by default), the real run is ``boundless bench programs``'s: a fresh
engine (or, with more than one instance, a fresh Ray cluster behind the real dispatcher, as ``boundless
serve --instances N`` runs it) behind the HTTP server, the programs through the ``openai`` client, in wall
time. It runs ``--repeats`` times, so the measured side's own noise shows: each row has every run, their
median (what the prediction is compared with) and their spread. The simulated run is the same engine flags,
cluster size and programs on a hardware profile: ``--profile`` for one instance, ``--cluster-profile`` for
more (on this 2-core machine each of two instances runs torch on one core, so its steps take a
one-thread profile's times). The defaults are fitted by ``calibrate --served`` on another grid of shapes,
through the same server and client (and cluster): a served step costs more than the bare engine's. A
simulation is deterministic: one run. Rows: average and p95 program latency and throughput (programs per
second of makespan), predicted against measured, with the relative error; and, with a fitted profile, the same
simulation again at the speed the real steps ran (:func:`at_step_speed`), to tell the simulator's error from the
machine's. ``--json`` also keeps every step each real run took (``real_steps``, with its end time), for
``calibrate --refit --check`` to tell which step classes a profile gets wrong.

With ``--kv-lending on`` every ``--instances`` case is a cluster whose instances lend KV blocks to each other
(Infinite-LLM), real and simulated (the real agents and gManager on the virtual clock, ``sim/lending.py``), with
the ``--lending-*`` flags on both sides; its label is ``2L``. Lending happens only when one instance runs out of
blocks while the other has room, so each such case also says how much was lent on each side (moves and blocks,
from the real engines' stats and the simulated agents'), and warns when a side lent nothing: then its rows
validate a cluster that did not lend.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from boundless.bench.programs import summarize
from boundless.bench.report import output_path, print_table, write_json
from boundless.bench.serve import percentile
from boundless.bench.workloads import WORKLOADS, ProgramSpec, WorkloadShape, make_programs
from boundless.cluster.lending_plan import served_request_pools
from boundless.config import (
    CacheConfig,
    ClusterConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    add_flags,
    comma_numbers,
    engine_config_from_flags,
    non_negative_float,
    positive_float,
    positive_int,
)
from boundless.engine.lending_stats import LendingStats
from boundless.sim.engine import SimulatedModel
from boundless.sim.profiles import FittedStepCost, HardwareProfile, profile_from_flag
from boundless.sim.run import parse_roles
from boundless.sim.served_grid import add_roles_arguments, roles_cluster_base, run_programs_on_a_fresh_engine
from boundless.sim.simulator import SimResult, Simulator
from boundless.sim.step_model import StepTimeModel, local_steps, samples_json

if TYPE_CHECKING:
    from boundless.engine.attention_time import AttentionSample
    from boundless.model.loader import LoadedModel

METRICS = ("avg_latency_s", "p95_latency_s", "throughput_programs_per_s")
# What the engines did, summed over instances: to tell a step model that is off (busy seconds per step differ)
# from latency spent elsewhere (the same busy seconds, a different latency).
ENGINE_FIGURES = ("busy_s", "steps")
# What KV lending did in a run, summed over instances (real: the engines' ``LendingStats``; simulated: the agents').
# ``exposed_wait_s``: the seconds debtors' layers waited for their creditors' partials after their own (the round
# trips' cost the steps show), to tell a link the profile assumes from the real transport's.
LENDING_FIGURES = (
    "moves",
    "blocks_moved",
    "bytes_moved",
    "round_trips",
    "exposed_wait_s",
    "requests_held",
    "requests_granted",
)
# The lending knobs validate takes, as ``boundless serve`` and ``simulate`` name them; both sides get them.
LENDING_FLAGS = (
    "lending_interval_s",
    "lending_debtor_max_batch",
    "lending_creditor_max_usage",
    "lending_creditor_headroom",
    "lending_min_gain",
    "lending_lookahead_chunks",
    "lending_reservation_timeout_s",
    "lending_request_pools",
)

# One real run of the programs (on a cluster, or one engine for None): their summary (``bench programs``'s
# ``summarize``), the engines' figures, and the profile's prediction for the steps they ran.
# ``steps_taken`` holds the steps themselves (AttentionSample), kept in the JSON to check a profile offline.
RealRun = Callable[[EngineConfig, list[ProgramSpec], ClusterConfig | None, HardwareProfile], dict]


@dataclass(frozen=True)
class Case:
    """One validated setting: a workload on a number of instances (lending KV blocks to each other with
    ``lending``), or on prefill and decode engines (``roles``: how many of each, ``instances`` their sum)."""

    workload: str
    instances: int
    roles: tuple[int, int] | None = None
    lending: bool = False

    @property
    def label(self) -> str:
        if self.roles:
            return f"{self.roles[0]}P{self.roles[1]}D"
        return f"{self.instances}L" if self.lending else str(self.instances)

    def cluster(self, base: ClusterConfig) -> ClusterConfig:
        """``base`` (the flags' links, read path and lending knobs) sized for this case."""
        if self.roles is None:
            return dataclasses.replace(base, instances=self.instances, kv_lending="on" if self.lending else "off")
        return dataclasses.replace(base, instances=1, prefill_instances=self.roles[0], decode_instances=self.roles[1])


def simulated_summary(results: list[SimResult]) -> dict[str, float]:
    """The figures ``bench programs``'s ``summarize`` reports, from simulated programs."""
    lat = [r.latency_s for r in results]
    makespan = max(r.finish_s for r in results) - min(r.arrival_s for r in results)
    return {
        "avg_latency_s": statistics.fmean(lat),
        "p95_latency_s": percentile(lat, 0.95),
        "throughput_programs_per_s": len(results) / makespan,
    }


def compare(
    predicted: dict[str, float],
    measured_runs: Sequence[dict[str, float]],
    at_step_speed: dict[str, float] | None = None,
) -> list[dict]:
    """One row per metric: the prediction against the median of the measured runs, with every run and their
    spread ((max - min) / median): a prediction cannot be checked closer than the measurement repeats. With
    ``at_step_speed`` (the simulation again at the speed the real steps ran: :func:`at_step_speed`), that one
    against the same median too."""
    rows = []
    for m in METRICS:
        runs = [float(r[m]) for r in measured_runs]
        median = statistics.median(runs)
        row = {
            "metric": m,
            "predicted": predicted[m],
            "measured": median,
            "measured_runs": runs,
            "spread": (max(runs) - min(runs)) / median,
            "rel_error": (predicted[m] - median) / median,
        }
        if at_step_speed is not None:
            row["at_step_speed"] = at_step_speed[m]
            row["rel_error_at_step_speed"] = (at_step_speed[m] - median) / median
        rows.append(row)
    return rows


def at_step_speed(profile: HardwareProfile, ratio: float) -> HardwareProfile | None:
    """``profile`` with every step ``ratio`` times its time (a fitted profile's; None for another).

    Not a prediction: with ``ratio`` the real runs' own steps over the profile's time for their shapes, it is the
    simulator given the speed the machine ran at, and its error what the simulator gets wrong beside the steps'
    cost (queueing, batching, the server and the client). This machine's speed moves by 15% within half an hour
    (docs/simulation.md, Validation), which no profile fitted before can carry."""
    if not isinstance(profile.step, FittedStepCost):
        return None
    return dataclasses.replace(profile, step=FittedStepCost(profile.step.model.scaled(ratio)))


def simulate(
    config: EngineConfig, programs: list[ProgramSpec], profile: HardwareProfile, cluster: ClusterConfig
) -> dict:
    """The programs in the simulator, on ``cluster.instances`` instances (or its prefill and decode engines) behind
    the real dispatcher; with lending, what it lent (``lending``: :data:`LENDING_FIGURES`)."""
    model = SimulatedModel.read(config.model)
    # With lending, the engines admit what the real cluster's do (`serve --kv-lending on`): the programs compact
    # their conversations at the same length on both sides.
    pools = served_request_pools(cluster)
    sim = Simulator(config, model, profile=profile, instances=cluster.instances, cluster=cluster, lending_pools=pools)
    summary = simulated_summary(sim.run(programs))
    counters = [i.core.counters for i in sim.instances.values()]
    out: dict = {**summary, "busy_s": sum(c.busy_seconds for c in counters), "steps": sum(c.steps for c in counters)}
    if sim.lending is not None:
        totals = sim.lending.totals()
        out["lending"] = {k: totals[k] for k in LENDING_FIGURES}
    return out


def lending_figures(predicted: dict, measured_runs: Sequence[dict]) -> dict:
    """What was lent on each side, so that a row within 10% cannot hide a run that lent nothing: the simulation's
    figures, every real run's, and whether either side lent nothing (in any real run)."""
    real = [r.get("lending") or dict.fromkeys(LENDING_FIGURES, 0) for r in measured_runs]
    simulated = predicted["lending"]
    return {
        "simulated": simulated,
        "real_runs": real,
        "simulated_lent_nothing": simulated["moves"] == 0,
        "real_lent_nothing": any(r["moves"] == 0 for r in real),
    }


def engine_figures(predicted: dict[str, float], measured_runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Busy seconds and steps, predicted and measured (median of the runs), and the ratio of the measured
    seconds per step to the predicted: above 1, the real steps ran slower than the profile says."""
    measured = {k: statistics.median(float(r[k]) for r in measured_runs) for k in ENGINE_FIGURES}
    per_step = (measured["busy_s"] / max(1.0, measured["steps"])) / (predicted["busy_s"] / max(1.0, predicted["steps"]))
    # The same steps, measured against the profile's time for their shapes (median over the runs).
    same_shapes = statistics.median(r["taken_step_s"] / r["profile_step_s"] for r in measured_runs)
    return {
        **{f"predicted_{k}": predicted[k] for k in ENGINE_FIGURES},
        **{f"measured_{k}": measured[k] for k in ENGINE_FIGURES},
        "step_time_ratio": per_step,
        "same_shape_ratio": same_shapes,
    }


def validate_case(
    case: Case,
    config: EngineConfig,
    shape: WorkloadShape,
    num_programs: int,
    rate: float,
    seed: int,
    profile: HardwareProfile,
    repeats: int,
    real_run: RealRun,
    base: ClusterConfig | None = None,
) -> dict:
    """Predicted against measured for one case: the simulation once, the real engine ``repeats`` times. ``base``:
    the cluster's flags other than its size (links, read path)."""
    programs = make_programs(case.workload, num_programs, rate, seed, shape)
    cluster = case.cluster(base or ClusterConfig())
    predicted = simulate(config, programs, profile, cluster)
    served = cluster if cluster.num_engines > 1 else None
    measured = [real_run(config, programs, served, profile) for _ in range(repeats)]
    engine = engine_figures(predicted, measured)
    at_speed = at_step_speed(profile, engine["same_shape_ratio"])
    lending = {"lending": lending_figures(predicted, measured)} if case.lending else {}
    return {
        "workload": case.workload,
        "instances": case.instances,
        "roles": case.label if case.roles else "",
        "kv_lending": "on" if case.lending else "off",
        "label": case.label,  # the cluster as the table names it: 2, 2L (lending) or 1P1D
        "profile": profile.name,
        "load_average": os.getloadavg()[0],
        "rows": compare(predicted, measured, simulate(config, programs, at_speed, cluster) if at_speed else None),
        "engine": engine,
        # Every step each real run took ([[cached, new] per request], seconds, as a profile keeps its samples):
        # what `calibrate --refit --check` measures against, to find which shapes a profile gets wrong.
        "real_steps": [samples_json(r.get("steps_taken", [])) for r in measured],
        **lending,
    }


def serve_and_measure(loaded: LoadedModel) -> RealRun:
    """The real run: ``bench programs``'s fresh engine or cluster, server and client (its
    ``served_engine``), with every step the engines ran taken as it goes, and what the profile predicts for
    those same step shapes: whether the profile is off on the served steps themselves, whatever the batching."""

    def run(
        config: EngineConfig, programs: list[ProgramSpec], cluster: ClusterConfig | None, profile: HardwareProfile
    ) -> dict:
        desc = "real engine" if cluster is None else "real cluster"
        served = run_programs_on_a_fresh_engine(loaded, config, cluster, programs, "bench", desc)
        results, steps, stats = served.results, served.steps, served.stats
        engines = len(stats)
        summary = summarize(results)
        if summary["failed_calls"]:
            raise RuntimeError(f"{summary['failed_calls']} calls failed on the real engine: {summary['first_error']}")
        figures = {m: float(summary[m]) for m in METRICS}  # type: ignore[arg-type]
        lending = {} if served.lending is None else {"lending": real_lending(served.lending)}
        return {
            **lending,
            **figures,
            "busy_s": float(sum(s.busy_seconds for s in stats)),
            "steps": float(sum(s.steps for s in stats)),
            "taken_step_s": sum(s.seconds for s in steps if not s.remote),  # as profile_step_s: the local steps
            "profile_step_s": profile_seconds(profile, steps, engines),
            "steps_taken": steps,
        }

    return run


def real_lending(total: LendingStats) -> dict[str, float]:
    """:data:`LENDING_FIGURES` of a real run from its instances' lending stats, summed: the moves each debtor
    committed."""
    return {
        "moves": total.moves_out,
        "blocks_moved": total.blocks_out,
        "bytes_moved": total.bytes_out,
        "round_trips": total.round_trips,
        "exposed_wait_s": total.exposed_wait_s,
        "requests_held": total.requests_held,
        "requests_granted": total.requests_granted,
    }


def profile_seconds(profile: HardwareProfile, steps: Sequence[AttentionSample], instances: int) -> float:
    """What the profile predicts for these real steps' shapes, summed; with a contended profile, each step with the
    contention it ran under (the other engines' steps beside it, from their end times). Steps over lent blocks are
    left out (``local_steps``: their round trips' waits are the lending cost's, not the step model's)."""
    model = getattr(profile.step, "model", None)
    if isinstance(model, StepTimeModel):  # a fitted profile: each step with its arrivals, departures, contention
        local = local_steps(steps, instances - 1 if model.per_contention_s else 0)
        return sum(model.predict_sample(s, c) for s, c in local)
    predict = getattr(profile.step, "predict", None)  # a roofline profile predicts from shapes
    return sum(predict(s.shapes) for s in steps if not s.remote) if predict is not None else float("nan")


def lending_lines(case: dict) -> list[str]:
    """What a lending case lent on each side, and a warning for a side that lent nothing."""
    if "lending" not in case:
        return []
    lent, where = case["lending"], f"{case['workload']} on {case['label']}"
    sim = lent["simulated"]

    def lent_line(r: dict) -> str:
        per_trip = 1e6 * r.get("exposed_wait_s", 0.0) / max(1, r["round_trips"])
        trips = f"{r['round_trips']} round trips, {per_trip:.0f} us exposed each"
        held, granted = r.get("requests_held", 0), r.get("requests_granted", 0)
        return f"{r['moves']} ({r['blocks_moved']} blocks, {trips}, {held} held, {granted} granted)"

    real = ", ".join(lent_line(r) for r in lent["real_runs"])
    lines = [f"{where}: lending moves {lent_line(sim)} simulated; real runs: {real}"]
    if lent["real_lent_nothing"]:
        lines.append(f"WARNING: {where}: a real run lent nothing; its rows do not validate lending")
    if lent["simulated_lent_nothing"]:
        lines.append(f"WARNING: {where}: the simulation lent nothing; its rows do not validate lending")
    return lines


def parse_cases(args: argparse.Namespace) -> list[Case]:
    """The clusters to validate, from ``--instances``, ``--roles`` and ``--kv-lending``, before their workloads."""
    lending = args.kv_lending == "on"
    counts = comma_numbers("--instances", args.instances, int, positive=True) if args.instances.strip() else []
    sizes = [Case("", n, lending=lending) for n in counts]
    roles = parse_roles(args.roles)
    if lending and roles:
        raise SystemExit(
            "--kv-lending on: lends between the --instances cases; prefill and decode engines (--roles) do not lend"
        )
    if lending and any(c.instances < 2 for c in sizes):
        raise SystemExit("--kv-lending on: needs --instances of 2 or more (one instance has no one to lend to)")
    sizes += [Case("", p + d, (p, d)) for p, d in roles]
    if not sizes:
        raise SystemExit("--instances and --roles: no case to validate")
    return sizes


def table_rows(cases: Sequence[dict]) -> list[list[str]]:
    return [
        [
            c["workload"],
            c["label"],
            r["metric"],
            f"{r['predicted']:.3f}",
            f"{r['measured']:.3f}",
            f"{r['spread']:.1%}",
            f"{r['rel_error']:+.1%}",
            f"{r['at_step_speed']:.3f}" if "at_step_speed" in r else "-",
            f"{r['rel_error_at_step_speed']:+.1%}" if "rel_error_at_step_speed" in r else "-",
        ]
        for c in cases
        for r in c["rows"]
    ]


def run(args: argparse.Namespace) -> dict:
    from boundless.model.loader import load_configured_model

    config = engine_config_from_flags(args)
    shape = WorkloadShape(scale=args.scale, tool_wait_s=args.tool_wait)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not workloads:
        raise SystemExit("--workloads: none named (comma-separated: chat, react, mapreduce, mcts)")
    sizes = parse_cases(args)
    for w in workloads:
        if w not in WORKLOADS or w == "trace":
            raise SystemExit(f"--workloads: unknown workload {w!r}")
    base = lending_cluster(roles_cluster_base(args), args)

    # One engine: --profile; more, each on its share of the cores: --cluster-profile; prefill and decode engines:
    # --roles-profile.
    def profile_flag(case: Case) -> tuple[str, str]:
        """The flag that names ``case``'s profile, and its value."""
        if case.roles:
            return "--roles-profile", args.roles_profile
        return ("--profile", args.profile) if case.instances == 1 else ("--cluster-profile", args.cluster_profile)

    # Before the model loads: a profile that is not there is its flag's one line.
    profiles = {name: profile_from_flag(flag, name) for flag, name in {profile_flag(c) for c in sizes}}
    loaded = load_configured_model(config.model)
    real_run = serve_and_measure(loaded)
    load_before = os.getloadavg()[0]
    cases = [
        validate_case(
            dataclasses.replace(size, workload=w),
            config,
            shape,
            args.num_programs,
            args.rate,
            args.bench_seed,
            profiles[profile_flag(size)[1]],
            args.repeats,
            real_run,
            base,
        )
        for w in workloads
        for size in sizes
    ]
    print_table(
        [
            "workload",
            "instances",
            "metric",
            "predicted",
            "measured (median)",
            "spread",
            "error",
            "at the real steps' speed",
            "error",
        ],
        table_rows(cases),
    )
    for c in cases:
        e = c["engine"]
        where = c["label"]
        for line in lending_lines(c):
            print(line)
        print(
            f"{c['workload']} on {where}: engine busy {e['predicted_busy_s']:.1f} s predicted,"
            f" {e['measured_busy_s']:.1f} s measured; seconds per step x{e['step_time_ratio']:.2f} the profile's;"
            f" the real steps took x{e['same_shape_ratio']:.2f} the profile's time for their own shapes (the last"
            " columns: the simulation again with every step that much longer, to tell the simulator's error from"
            " the machine's speed)"
        )
    result = {
        "num_programs": args.num_programs,
        "rate": args.rate,
        "scale": args.scale,
        "repeats": args.repeats,
        "load_average_before": load_before,
        "cases": cases,
        # Every row with its case, flat, for tables.
        "rows": [
            {
                "workload": c["workload"],
                "instances": c["instances"],
                "roles": c["roles"],
                "kv_lending": c["kv_lending"],
                **r,
            }
            for c in cases
            for r in c["rows"]
        ],
    }
    if args.json:
        write_json(args.json, result)
    return result


LENDING_HELP = (
    "on: every --instances case (2 or more) is a cluster whose instances lend KV blocks to each other, real and"
    " simulated, labelled 2L (not with --roles); its output says how much each side lent"
)


def add_lending_arguments(parser: argparse.ArgumentParser, kv_lending_help: str = LENDING_HELP) -> None:
    """``--kv-lending`` (``kv_lending_help`` says what it does in the command) and the lending knobs, with
    ``boundless serve``'s names, defaults and help."""
    parser.add_argument("--kv-lending", default="off", choices=("on", "off"), help=kv_lending_help)
    add_flags(parser, ClusterConfig, only=LENDING_FLAGS)


def lending_cluster(base: ClusterConfig, args: argparse.Namespace) -> ClusterConfig:
    """``base`` with the lending knobs of :func:`add_lending_arguments`' flags (a flag error for a bad one)."""
    try:
        return dataclasses.replace(base, **{name: getattr(args, name) for name in LENDING_FLAGS})
    except ConfigError as e:
        raise SystemExit(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="chat,mapreduce", help="comma-separated: chat, react, mapreduce, mcts")
    parser.add_argument("--instances", default="1,2", help="comma-separated cluster sizes to validate ('' for none)")
    add_roles_arguments(
        parser,
        "comma-separated prefill:decode engine counts to validate too (e.g. 1:1: a prefill engine and a decode "
        "engine, real and simulated, with the read path --kv-path and the links --storage-gbps, --net-gbps)",
    )
    add_lending_arguments(parser)
    parser.add_argument(
        "--repeats", type=positive_int, default=3, help="real runs per case (the simulation is deterministic)"
    )
    parser.add_argument("--num-programs", type=positive_int, default=16)
    parser.add_argument("--rate", type=non_negative_float, default=0.2)
    parser.add_argument("--scale", type=positive_float, default=0.1)
    parser.add_argument("--tool-wait", type=non_negative_float, default=0.2)
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        default="cpu-served",
        help="the simulator's hardware profile for one instance: a name or a file (calibrate --served writes one"
        " fitted as the real side here serves the engine)",
    )
    parser.add_argument(
        "--cluster-profile",
        default="cpu-served-2inst",
        help="the profile for more than one instance (calibrate --served --instances 2: each instance of two gets"
        " one core and shares them with the other and the driver)",
    )
    parser.add_argument(
        "--roles-profile",
        default="cpu-served-1p1d",
        help="the profile for --roles (calibrate --served --roles 1:1 with the same --kv-path, links and disk store:"
        " the shipped one with --kv-path dualpath --storage-gbps 8 --net-gbps 16 --kv-write-policy through)",
    )
    parser.add_argument(
        "--json", metavar="PATH", type=output_path, help="write each row with its relative error to this file"
    )
    add_flags(parser, ModelConfig)
    add_flags(parser, CacheConfig)
    add_flags(parser, SchedulerConfig)
