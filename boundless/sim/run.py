"""``boundless simulate``: policies side by side on a workload, in virtual time."""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from boundless.bench.report import print_table, write_json
from boundless.bench.serve import percentile
from boundless.bench.workloads import WORKLOADS, WorkloadShape, make_programs
from boundless.config import SchedulerConfig, from_flags
from boundless.sim.simulator import CostModel, Simulator


def run(args: argparse.Namespace) -> dict:
    base = from_flags(SchedulerConfig, args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    shape = WorkloadShape(scale=args.scale, tool_wait_s=args.tool_wait)
    cost = CostModel(args.step_base_s, args.step_per_token_s, args.step_per_seq_s)
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        programs = make_programs(args.workload, args.num_programs, rate, args.bench_seed, shape)
        for policy in policies:
            sim = Simulator(
                dataclasses.replace(base, policy=policy),
                num_blocks=args.num_kv_blocks,
                block_size=args.block_size,
                num_host_blocks=args.num_host_blocks,
                cost=cost,
                max_model_len=args.max_model_len,
            )
            results = sim.run(programs)
            lat = [r.latency_s for r in results]
            rows.append(
                {
                    "rate": rate,
                    "policy": policy,
                    "avg_latency_s": statistics.fmean(lat),
                    "p95_latency_s": percentile(lat, 0.95),
                    "p99_latency_s": percentile(lat, 0.99),
                    "avg_latency_per_token_s": statistics.fmean(r.latency_s / max(1, r.output_tokens) for r in results),
                    "preemptions": sim.scheduler.stats.num_preemptions,
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
    result = {"workload": args.workload, "num_programs": args.num_programs, "rows": rows, "virtual_time": True}
    if args.json:
        write_json(args.json, result)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=[w for w in WORKLOADS if w != "trace"], default="chat")
    parser.add_argument("--policies", default="fcfs,mlfq,plas,atlas")
    parser.add_argument("--rates", default="0.1,0.2,0.3,0.4")
    parser.add_argument("--num-programs", type=int, default=150)
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--tool-wait", type=float, default=0.2)
    parser.add_argument(
        "--num-kv-blocks", type=int, default=160, help="a small pool makes memory the bottleneck, as on a GPU"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context length programs compact to (default: the KV pool)"
    )
    parser.add_argument("--num-host-blocks", type=int, default=512)
    parser.add_argument("--step-base-s", type=float, default=CostModel.base_s)
    parser.add_argument("--step-per-token-s", type=float, default=CostModel.per_token_s)
    parser.add_argument("--step-per-seq-s", type=float, default=CostModel.per_seq_s)
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
