"""``boundless simulate``: policies side by side on a workload, in virtual time.

The engine flags (model, KV cache, scheduler) and their defaults are ``boundless bench programs``'s:
the simulated engine is sized from them exactly as the real one is.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from boundless.bench.report import print_table, write_json
from boundless.bench.serve import percentile
from boundless.bench.workloads import WORKLOADS, WorkloadShape, make_programs
from boundless.config import CacheConfig, ClusterConfig, ModelConfig, add_flags, engine_config_from_flags
from boundless.sim.cost import CostModel
from boundless.sim.engine import SimulatedModel
from boundless.sim.profiles import load_profile, profile_names
from boundless.sim.progress import VirtualTimeBar
from boundless.sim.simulator import Simulator


def run(args: argparse.Namespace) -> dict:
    base = engine_config_from_flags(args)
    model = SimulatedModel.read(base.model)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    shape = WorkloadShape(scale=args.scale, tool_wait_s=args.tool_wait)
    profile = load_profile(args.profile) if args.profile else None
    cost = None if profile else CostModel(args.step_base_s, args.step_per_token_s, args.step_per_seq_s)
    cluster = cluster_config_from_flags(args)
    rows: list[dict] = []
    walls: list[float] = []  # apart from the rows, which are a function of the flags alone
    for rate in [float(r) for r in args.rates.split(",")]:
        programs = make_programs(args.workload, args.num_programs, rate, args.bench_seed, shape)
        for policy in policies:
            config = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, policy=policy))
            sim = Simulator(
                config,
                model,
                cost,
                instances=cluster.instances,
                cluster=cluster,
                profile=profile,
                instances_per_node=args.instances_per_node,
            )
            bar = VirtualTimeBar(programs[-1].arrival_s if programs else 0.0, f"{policy} @ {rate}/s", args.progress)
            start = time.perf_counter()
            results = sim.run(programs, bar)
            wall_s = time.perf_counter() - start
            bar.close()
            walls.append(wall_s)
            lat = [r.latency_s for r in results]
            rows.append(
                {
                    "rate": rate,
                    "policy": policy,
                    "avg_latency_s": statistics.fmean(lat),
                    "p95_latency_s": percentile(lat, 0.95),
                    "p99_latency_s": percentile(lat, 0.99),
                    "avg_latency_per_token_s": statistics.fmean(r.latency_s / max(1, r.output_tokens) for r in results),
                    "preemptions": sum(i.core.stats().num_preemptions for i in sim.instances.values()),
                    "calls_per_instance": calls_per_instance(sim),
                    "simulated_s": sim.clock.now,
                    "steps": sim.num_steps,
                    "failed_calls": sum(r.failed_calls for r in results),
                }
            )
    table = []
    for row in rows:
        ref = next((r for r in rows if r["rate"] == row["rate"] and r["policy"] == "fcfs"), None)
        table.append(
            [
                row["rate"],
                row["policy"],
                f"{row['avg_latency_s']:.1f}",
                f"{row['p95_latency_s']:.1f}",
                f"{row['p99_latency_s']:.1f}",
                f"{row['avg_latency_per_token_s'] * 1000:.0f}",
                row["preemptions"],
                f"{ref['avg_latency_s'] / row['avg_latency_s']:.2f}x" if ref else "-",
            ]
        )
    print_table(["rate/s", "policy", "avg s", "p95 s", "p99 s", "ms/token", "preemptions", "avg vs fcfs"], table)
    simulated, wall, steps = sum(r["simulated_s"] for r in rows), sum(walls), sum(r["steps"] for r in rows)
    print(
        f"simulated {simulated:.0f} s of {cluster.instances} instance(s) in {wall:.1f} s wall:"
        f" {simulated / max(wall, 1e-9):.1f} simulated s per wall s,"
        f" {steps / max(wall, 1e-9):.0f} engine steps per wall s"
    )
    failed = sum(row["failed_calls"] for row in rows)
    if failed:  # a refused call takes no time: the latencies above would flatter the run
        print(f"{failed} calls were refused by the engine (too long for --max-model-len): these figures are invalid")
    result = {
        "workload": args.workload,
        "num_programs": args.num_programs,
        "instances": cluster.instances,
        "profile": profile.name if profile else None,
        "rows": rows,
        "virtual_time": True,
        "speed": {
            "wall_s": wall,
            "simulated_s": simulated,
            "steps": steps,
            "simulated_s_per_wall_s": simulated / max(wall, 1e-9),
            "row_wall_s": walls,
        },
    }
    if args.json:
        write_json(args.json, result)
    return result


def calls_per_instance(sim: Simulator) -> dict[str, int]:
    counts = dict.fromkeys(sim.instances, 0)
    for placement in sim.placements:
        counts[placement.instance_id] += 1
    return counts


# The cluster's flags the simulator uses: the same names and defaults as ``boundless serve``'s.
CLUSTER_FLAGS = ("instances", "routing", "locality_threshold", "locality_max_imbalance", "heartbeat_interval_s")


def cluster_config_from_flags(args: argparse.Namespace) -> ClusterConfig:
    config = ClusterConfig(**{name: getattr(args, name) for name in CLUSTER_FLAGS})
    if config.instances < 1:
        raise SystemExit("--instances must be at least 1")
    return config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=[w for w in WORKLOADS if w != "trace"], default="chat")
    parser.add_argument("--policies", default="fcfs,mlfq,plas,atlas")
    parser.add_argument("--rates", default="0.1,0.2,0.3,0.4")
    parser.add_argument("--num-programs", type=int, default=150)
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--tool-wait", type=float, default=0.2)
    parser.add_argument(
        "--profile",
        help=f"hardware profile: {', '.join(profile_names())} or a profile file (boundless simulate calibrate writes "
        "one); without it, the --step-* linear model",
    )
    parser.add_argument(
        "--instances-per-node",
        type=int,
        default=0,
        help="instances of a node read the disk store over one shared storage link, their per-instance bandwidths "
        "summed (0: each its own)",
    )
    parser.add_argument("--step-base-s", type=float, default=CostModel.base_s)
    parser.add_argument("--step-per-token-s", type=float, default=CostModel.per_token_s)
    parser.add_argument("--step-per-seq-s", type=float, default=CostModel.per_seq_s)
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the rows (with the run's speed) to this file")
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="a progress bar on stderr"
    )
    fields = {f.name: f for f in dataclasses.fields(ClusterConfig)}
    for name in CLUSTER_FLAGS:
        f = fields[name]
        parser.add_argument(
            "--" + name.replace("_", "-"), type=type(f.default), default=f.default, help=f.metadata["help"]
        )
    # The engine's own flags (the scheduler's are added with them by the command line).
    add_flags(parser, ModelConfig)
    add_flags(parser, CacheConfig)
