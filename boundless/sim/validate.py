"""``boundless simulate validate``: the real engine and the simulator on the same workload, side by side.

One instance. The real run is ``boundless bench programs``'s (a fresh engine behind the HTTP server, the
programs through the ``openai`` client, in wall time); the simulated run is the same engine flags and the
same programs on a hardware profile (``cpu`` by default: fitted on this machine by ``calibrate``). Rows:
average and p95 program latency and throughput (programs per second of makespan), predicted against
measured, with the relative error.
"""

from __future__ import annotations

import argparse
import statistics

from boundless.bench.programs import _serve_and_run
from boundless.bench.report import print_table, write_json
from boundless.bench.serve import percentile
from boundless.bench.workloads import WORKLOADS, WorkloadShape, make_programs
from boundless.config import CacheConfig, ModelConfig, SchedulerConfig, add_flags, engine_config_from_flags
from boundless.sim.engine import SimulatedModel
from boundless.sim.profiles import load_profile
from boundless.sim.simulator import SimResult, Simulator

METRICS = ("avg_latency_s", "p95_latency_s", "throughput_programs_per_s")


def simulated_summary(results: list[SimResult]) -> dict[str, float]:
    """The figures ``bench programs``'s ``summarize`` reports, from simulated programs."""
    lat = [r.latency_s for r in results]
    makespan = max(r.finish_s for r in results) - min(r.arrival_s for r in results)
    return {
        "avg_latency_s": statistics.fmean(lat),
        "p95_latency_s": percentile(lat, 0.95),
        "throughput_programs_per_s": len(results) / makespan,
    }


def compare(predicted: dict[str, float], measured: dict[str, float]) -> list[dict]:
    return [
        {
            "metric": m,
            "predicted": predicted[m],
            "measured": measured[m],
            "rel_error": (predicted[m] - measured[m]) / measured[m],
        }
        for m in METRICS
    ]


def run(args: argparse.Namespace) -> dict:
    from boundless.model.loader import load_model

    config = engine_config_from_flags(args)
    shape = WorkloadShape(scale=args.scale, tool_wait_s=args.tool_wait)
    programs = make_programs(args.workload, args.num_programs, args.rate, args.bench_seed, shape)
    profile = load_profile(args.profile)
    sim = Simulator(config, SimulatedModel.read(config.model), profile=profile)
    predicted = simulated_summary(sim.run(programs))
    loaded = load_model(config.model.model, dtype=config.model.dtype, device=config.model.device)
    measured, _ = _serve_and_run(config, loaded, programs, "real engine", None)
    if measured["failed_calls"]:
        print(f"{measured['failed_calls']} calls failed on the real engine: these figures are invalid")
    rows = compare(predicted, {m: float(measured[m]) for m in METRICS})  # type: ignore[arg-type]
    print_table(
        ["metric", "predicted", "measured", "error"],
        [[r["metric"], f"{r['predicted']:.3f}", f"{r['measured']:.3f}", f"{r['rel_error']:+.1%}"] for r in rows],
    )
    result = {
        "workload": args.workload,
        "num_programs": args.num_programs,
        "rate": args.rate,
        "profile": profile.name,
        "rows": rows,
    }
    if args.json:
        write_json(args.json, result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=[w for w in WORKLOADS if w != "trace"], default="chat")
    parser.add_argument("--num-programs", type=int, default=16)
    parser.add_argument("--rate", type=float, default=0.2)
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--tool-wait", type=float, default=0.2)
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument(
        "--profile", required=True, help="the simulator's hardware profile: a name or a file (calibrate writes one)"
    )
    parser.add_argument("--json", metavar="PATH", help="write each row with its relative error to this file")
    add_flags(parser, ModelConfig)
    add_flags(parser, CacheConfig)
    add_flags(parser, SchedulerConfig)
